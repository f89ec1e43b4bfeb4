"""Chat-formatted prompts (qarl/tasks/chat.py): the tokenizer's template or raw text, the token that ends an answer,
and the refusals; on the embedded tokenizer and on tokenizers laid out like Qwen's (ChatML) and Llama 3's."""

from __future__ import annotations

import pytest
from tokenizers import processors

from qarl.config import ConfigError, TaskConfig
from qarl.models.tiny import build_tokenizer
from qarl.tasks import ArithmeticTask, prompt_format

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + "
          "m['content'] + '<|eot_id|>' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")


def chatml_tokenizer():
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    return tokenizer


def llama3_tokenizer():
    """A tokenizer that puts a BOS before every text it encodes, as Llama 3's does, and whose template writes one."""
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"bos_token": "<|begin_of_text|>",
                                  "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    bos = tokenizer.convert_tokens_to_ids("<|begin_of_text|>")
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)])
    tokenizer.chat_template = LLAMA3
    return tokenizer


def test_the_embedded_tokenizer_asks_through_its_template_and_ends_answers_with_its_end_of_turn():
    tokenizer = build_tokenizer()
    chat = prompt_format(tokenizer, TaskConfig())  # auto: the embedded tokenizer has a template
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    assert chat.chat and chat.end_id == end and chat.stop_ids == sorted({end, tokenizer.eos_token_id})
    assert chat.text("40213>") == "<|user|>40213><|end|><|assistant|>"
    ids = chat.ids("40213>")
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|user|>") and ids[-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")
    assert ids[1:7] == tokenizer("40213>").input_ids  # the markers are single tokens, never spelled out
    assert chat.answer_ids("31204") == tokenizer("31204").input_ids + [end]
    assert tokenizer.decode(chat.answer_ids("31204"), skip_special_tokens=True) == "31204"  # what the reward reads
    assert chat.answered_text("1>", "1") == "<|user|>1><|end|><|assistant|>1<|end|>"
    with_system = prompt_format(tokenizer, TaskConfig(system_prompt="Reverse the digits."))
    assert with_system.text("1>").startswith("<|system|>Reverse the digits.<|end|><|user|>1>")

    raw = prompt_format(tokenizer, TaskConfig(chat_template="off"))
    assert not raw.chat and raw.ids("40213>") == tokenizer("40213>").input_ids  # as before the template existed
    assert raw.end_id == tokenizer.eos_token_id and raw.stop_ids == [tokenizer.eos_token_id]
    assert prompt_format(tokenizer, TaskConfig(chat_template=False)).chat is False  # YAML's bare `off`


def test_calibration_texts_are_formatted_as_training_sees_them():
    task, tokenizer = ArithmeticTask(num_train=4, num_eval=2), build_tokenizer()
    chat = prompt_format(tokenizer, TaskConfig())
    assert task.calibration_texts(2, chat) == [f"<|user|>{p.prompt}<|end|><|assistant|>{p.answer}<|end|>"
                                               for p in task.train[:2]]
    assert task.calibration_texts(2) == [p.prompt + p.answer for p in task.train[:2]]


def test_the_end_of_turn_is_found_in_templates_laid_out_like_qwen_and_llama3():
    qwen = chatml_tokenizer()
    fmt = prompt_format(qwen, TaskConfig())
    assert fmt.end_id == qwen.convert_tokens_to_ids("<|im_end|>")
    assert fmt.text("2+2=") == "<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n"

    llama = llama3_tokenizer()
    fmt = prompt_format(llama, TaskConfig())
    bos = llama.bos_token_id
    assert fmt.end_id == llama.convert_tokens_to_ids("<|eot_id|>")
    ids = fmt.ids("2+2=")
    assert ids[0] == bos and bos not in ids[1:]  # the template's BOS, not a second one from the tokenizer
    assert prompt_format(llama, TaskConfig(chat_template="off")).ids("2+2=")[0] == bos  # raw text keeps its BOS
    assert fmt.stop_ids == sorted({fmt.end_id, llama.eos_token_id})
    named = prompt_format(llama, TaskConfig(stop_token="<|end_header_id|>"))  # a named token wins over the search
    assert named.end_id == llama.convert_tokens_to_ids("<|end_header_id|>")


def test_settings_that_cannot_format_are_refused_naming_the_setting():
    tokenizer = build_tokenizer()
    with pytest.raises(ConfigError, match="task.chat_template='sometimes'"):
        prompt_format(tokenizer, TaskConfig(chat_template="sometimes"))
    with pytest.raises(ConfigError, match="task.stop_token='<|nope|>' is not one token"):
        prompt_format(tokenizer, TaskConfig(stop_token="<|nope|>"))
    plain = build_tokenizer()
    plain.chat_template = None
    with pytest.raises(ConfigError, match="task.chat_template=on, but this tokenizer has no chat template"):
        prompt_format(plain, TaskConfig(chat_template="on"))
    with pytest.raises(ConfigError, match="task.system_prompt needs a chat template"):
        prompt_format(plain, TaskConfig(system_prompt="hi"))
    assert prompt_format(plain, TaskConfig()).chat is False  # auto without a template: raw text
    silent = build_tokenizer()
    silent.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # nothing closes a turn
    with pytest.raises(ConfigError, match="set task.stop_token"):
        prompt_format(silent, TaskConfig())
