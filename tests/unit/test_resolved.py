"""A run resolves its recipe once (qarl.run.Resolved): the model's directory, the two formats and the tokenizer are
looked up as the run starts and carried from there, not again by the checks, the memory plan, the policy or the
engine."""

from __future__ import annotations

import transformers

import qarl.run
from qarl.config import RecipeConfig, load_recipe


def test_start_run_resolves_the_model_formats_and_tokenizer_once(tmp_path, monkeypatch):
    calls = {"model_dir": 0, "format": 0, "tokenizer": 0}

    def counted(key, fn):
        def wrapper(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(qarl.run, "resolve_model_dir", counted("model_dir", qarl.run.resolve_model_dir))
    monkeypatch.setattr(qarl.run, "resolve_format", counted("format", qarl.run.resolve_format))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        counted("tokenizer", transformers.AutoTokenizer.from_pretrained))
    cfg = load_recipe("recipes/qa_grpo_tiny.yaml", [f"run.dir={tmp_path / 'run'}", "warm_start.enabled=false",
                                                    "policy.quant_calib_size=8"], RecipeConfig)
    run = qarl.run.start_run(cfg)
    assert calls == {"model_dir": 1, "format": 2, "tokenizer": 1}
    assert run.policy.tokenizer is run.prompts.tokenizer
    assert run.policy.format.fingerprint() == run.resolved.policy_format.fingerprint()
