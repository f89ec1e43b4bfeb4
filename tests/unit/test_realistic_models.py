"""The realistic embedded models (`embedded:realistic-<family>`, qarl/models/tiny.py): each family's attention at the
shape its released models have, and the activations trained weights give (outlier channels and massive activations
in the residual stream, spread norm gains, peaked attention and output distributions) planted in random weights,
deterministic from the seed. Random weights alone never showed the train/rollout drift real weights did."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from qarl.models import tiny

FAMILIES = ["gemma3", "llama3"]  # the offset (1 + w) norms and q/k norms; plain norms, no q/k norms


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, torch.nn.Module]:
    root = tmp_path_factory.mktemp("realistic")
    return {family: AutoModelForCausalLM.from_pretrained(tiny.make_tiny_model(root / family, "realistic", 0, family))
            for family in FAMILIES}


def prompt() -> torch.Tensor:
    """A chat turn's opening token, then 79 random ones."""
    ids = torch.randint(3, 100, (1, 80), generator=torch.Generator().manual_seed(7))
    ids[0, 0] = tiny.build_tokenizer().convert_tokens_to_ids(tiny.CHAT_TOKENS[1])
    return ids


@pytest.mark.parametrize("family", FAMILIES)
def test_attention_has_the_familys_real_shape(models, family):
    config = models[family].config
    hidden, heads, kv_heads, head_dim = tiny.REALISTIC_ATTENTION[family]
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (hidden, heads, kv_heads)
    assert models[family].model.layers[0].self_attn.head_dim == head_dim
    assert config.num_hidden_layers == 6
    if family == "gemma3":  # five sliding layers to a global one (Gemma 3's), a window shorter than the prompts
        assert config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
        assert config.sliding_window == 16 and config.query_pre_attn_scalar == 256


@pytest.mark.parametrize("family", FAMILIES)
def test_activations_are_real_like(models, family):
    model = models[family]
    ids = prompt()
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    for residual in out.hidden_states[:-1]:  # (the last is the final norm's output)
        magnitude = residual[0].abs()
        typical = magnitude[1:].median()
        channels = magnitude[1:].mean(0).topk(tiny.OUTLIER_CHANNELS).values
        assert channels.min() > 8 * typical  # outlier channels in every token
        assert magnitude[0].max() > 50 * typical  # a massive activation where the turn opens
    for layer in model.model.layers:
        assert 3.0 < tiny._attention_logit_std(model, ids, layer.self_attn) < 5.5  # peaked attention rows
    assert 2.0 < out.logits.std(-1).mean() < 4.5
    logprobs = out.logits.log_softmax(-1)
    entropy = -(logprobs.exp() * logprobs).sum(-1).mean()
    assert 0.5 < entropy < 0.8 * torch.tensor(out.logits.shape[-1]).log()  # peaked, not uniform, not one token
    offset = 1.0 if family == "gemma3" else 0.0
    gains = torch.cat([norm.weight + offset for norm in tiny.rms_norms(model)])
    assert gains.min() >= 0 and gains.max() > 10 * gains.median()  # spread gains, outlier channels among them
    assert (model.model.norm.weight + offset == 0).sum() == tiny.OUTLIER_CHANNELS  # the head reads no outlier
    if family == "gemma3":  # (1 + w) norms hold w = gain - 1
        assert (torch.cat([norm.weight for norm in tiny.rms_norms(model)]) < 0).any()


def test_realistic_models_are_deterministic_and_cached_by_identity(models, tmp_path):
    again = tiny.build_model("realistic", tiny.build_tokenizer(), 0, "gemma3")
    theirs = models["gemma3"].state_dict()
    assert all(torch.equal(t, theirs[name]) for name, t in again.state_dict().items())
    other = tiny.build_model("realistic", tiny.build_tokenizer(), 1, "gemma3").state_dict()
    assert not torch.equal(other["model.embed_tokens.weight"], theirs["model.embed_tokens.weight"])
    made = tiny.make_tiny_model(tmp_path / "g", "realistic", 0, "gemma3")
    identity = json.loads((made / "qarl_embedded.json").read_text())
    assert identity["activations"] == tiny.REALISTIC_VERSION and identity["spec"]["num_key_value_heads"] == 1
