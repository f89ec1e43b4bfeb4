"""How a prompt reaches the model: through the tokenizer's chat template or as raw text, and which token ends
an answer.

An instruct model asked in raw text never closes its turn, so every answer runs to the token limit; the model
sees a user turn it knows only when the prompt goes through its own chat template (a system turn first if
`task.system_prompt` is set, the assistant's turn opened at the end). The answer then ends with the token the
template closes a turn with (`<|im_end|>` for Qwen, `<|eot_id|>` for Llama 3, `<end_of_turn>` for Gemma), which
the engine stops on beside EOS and the warm start teaches. Training, evaluation, calibration and the matrix all
format through one `PromptFormat`, so they never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from qarl.config import ConfigError, RecipeConfig, TaskConfig, switch_mode

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_PROBE = "qarl-probe-answer"  # an assistant message whose rendering shows the token that closes a turn


def chat_mode(cfg: TaskConfig) -> str:
    """`task.chat_template` as one of auto, on, off."""
    return switch_mode(cfg.chat_template, "task.chat_template")


@dataclass(frozen=True)
class PromptFormat:
    """A tokenizer's way of asking: `ids(prompt)` the tokens the model sees, `answer_ids(answer)` an answer as
    the model should write it (ended by `end_id`), `stop_ids` what ends a sample in the engine."""

    tokenizer: PreTrainedTokenizerBase
    chat: bool  # through the tokenizer's chat template
    system_prompt: str
    end_id: int  # the token an answer ends with: the template's end of turn, or EOS

    def text(self, prompt: str) -> str:
        """The prompt as the model reads it (special tokens spelled out)."""
        if not self.chat:
            return prompt
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages.append({"role": "user", "content": prompt})
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def ids(self, prompt: str) -> list[int]:
        # a rendered template brings its own BOS where the model wants one
        return list(self.tokenizer(self.text(prompt), add_special_tokens=not self.chat).input_ids)

    def batch(self, prompts: list[str]) -> list[list[int]]:
        return [self.ids(p) for p in prompts]

    def answer_ids(self, answer: str) -> list[int]:
        return list(self.tokenizer(answer, add_special_tokens=False).input_ids) + [self.end_id]

    def answered_text(self, prompt: str, answer: str) -> str:
        """A prompt and its answer as one text, ended as the model should end it (calibration data)."""
        return self.text(prompt) + answer + (self.tokenizer.convert_ids_to_tokens(self.end_id) if self.chat else "")

    @property
    def stop_ids(self) -> list[int]:
        eos = self.tokenizer.eos_token_id
        return sorted({self.end_id} | ({eos} if eos is not None else set()))


def end_of_turn(tokenizer: PreTrainedTokenizerBase, stop_token: str) -> int:
    """The token the chat template closes an assistant turn with: `stop_token` if set, else the first special token
    the template writes after an assistant message."""
    if stop_token:
        found = tokenizer.convert_tokens_to_ids(stop_token)
        if found is None or found == tokenizer.unk_token_id:
            raise ConfigError(f"task.stop_token={stop_token!r} is not one token of this tokenizer; name the token "
                              "its chat template ends a turn with")
        return found
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": _PROBE}], tokenize=False)
    tail = rendered.split(_PROBE, 1)[1] if _PROBE in rendered else ""
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    for token in tokenizer(tail, add_special_tokens=False).input_ids:
        if token in special:
            return token
    raise ConfigError("the tokenizer's chat template writes no special token after an assistant turn, so qarl cannot "
                      "tell what ends an answer; set task.stop_token to that token, or task.chat_template=off")


def prompt_format(tokenizer: PreTrainedTokenizerBase, cfg: TaskConfig) -> PromptFormat:
    """The prompt format `cfg` asks of this tokenizer: its chat template when it has one (auto) or when asked (on,
    refused for a tokenizer without one), else the raw prompt ended by EOS."""
    mode = chat_mode(cfg)
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if mode == "on" and not has_template:
        raise ConfigError("task.chat_template=on, but this tokenizer has no chat template; use a tokenizer with one, "
                          "or task.chat_template=off (raw prompts) or auto")
    chat = has_template and mode != "off"
    if cfg.system_prompt and not chat:
        raise ConfigError("task.system_prompt needs a chat template (task.chat_template=auto or on with a tokenizer "
                          "that has one); raw prompts have no system turn")
    if chat or cfg.stop_token:
        end = end_of_turn(tokenizer, cfg.stop_token)
    elif tokenizer.eos_token_id is None:
        raise ConfigError("the tokenizer has no EOS token to end an answer with; give it one or use a chat template")
    else:
        end = tokenizer.eos_token_id
    return PromptFormat(tokenizer, chat, cfg.system_prompt, end)


def model_prompt_format(model_dir: str, cfg: TaskConfig, trust_remote_code: bool = False) -> PromptFormat:
    """The prompt format `cfg` asks of the tokenizer in `model_dir`."""
    from transformers import AutoTokenizer

    return prompt_format(AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code), cfg)


def recipe_prompt_format(cfg: RecipeConfig) -> PromptFormat:
    """The prompt format of a recipe: its task settings on its policy model's tokenizer (a warm start keeps the
    base's tokenizer, so this is the run's tokenizer too)."""
    from qarl.models.resolve import resolve_model_dir

    return model_prompt_format(resolve_model_dir(cfg.policy.model_name), cfg.task, cfg.policy.trust_remote_code)
