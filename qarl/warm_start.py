"""A short supervised warm start: teach the base model the task's answer format on the training split.

RL learns nothing from a reward that is never non-zero, and the embedded model starts from random
weights. A few hundred SFT steps give it a real but low success rate. The result is cached under
a key of everything it depends on, so the QA-GRPO run and its bf16 baseline start from one model.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from qarl.config import TaskConfig, WarmStartConfig
from qarl.console import progress_bar
from qarl.distributed import exclusive
from qarl.files import give_umask_modes
from qarl.models.resolve import default_device
from qarl.tasks import Problem, prompt_format
from qarl.tasks.chat import chat_mode


def fingerprint(model_dir: str, problems: list[Problem], cfg: WarmStartConfig, seed: int, chat: TaskConfig) -> str:
    """The warm start's cache key: the model (its files that shape the result: config, tokenizer and chat template),
    the settings, the seed, the problems and how their prompts are formatted."""
    h = hashlib.sha256()
    identity = Path(model_dir) / "qarl_embedded.json"
    h.update((identity.read_text() if identity.is_file() else str(Path(model_dir).resolve())).encode())
    for name in ("config.json", "tokenizer_config.json", "chat_template.jinja"):
        file = Path(model_dir) / name
        h.update(file.read_bytes() if file.is_file() else b"")
    # the seed in effect is hashed beside; `enabled` only says whether to run it
    settings = {k: v for k, v in asdict(cfg).items() if k not in ("seed", "enabled")}
    formatting = [chat_mode(chat), chat.system_prompt, chat.stop_token]
    h.update(json.dumps([settings, seed, [(p.prompt, p.answer) for p in problems], formatting]).encode())
    return h.hexdigest()[:16]


def warm_start(model_dir: str, problems: list[Problem], cfg: WarmStartConfig, seed: int, cache: Path,
               chat: TaskConfig) -> str:
    """Fine-tune `model_dir` on prompt -> answer<end> (loss on the answer), the prompts formatted as `chat` asks
    (the answer ended by the chat template's end of turn, or EOS), and return the new directory."""
    out = cache / "warm_start" / fingerprint(model_dir, problems, cfg, seed, chat)
    with exclusive(out.with_name(out.name + ".lock")):  # one process trains it; the others then read it
        if (out / "COMPLETE").is_file():
            return str(out)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        prompts = prompt_format(tokenizer, chat)
        device = default_device()
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
        torch.manual_seed(seed)
        rng = random.Random(seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20) * max(0.0, 1 - s / cfg.steps))
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else prompts.end_id
        model.train()
        bar = progress_bar(range(cfg.steps), desc="warm start (SFT)", unit="step")
        for _ in bar:
            batch = rng.sample(problems, min(cfg.batch_size, len(problems)))
            questions = [prompts.ids(p.prompt) for p in batch]
            answers = [prompts.answer_ids(p.answer) for p in batch]
            width = max(len(p) + len(a) for p, a in zip(questions, answers))
            ids = torch.full((len(batch), width), pad)
            labels = torch.full((len(batch), width), -100)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, (p, a) in enumerate(zip(questions, answers)):
                ids[i, : len(p) + len(a)] = torch.tensor(p + a)
                labels[i, len(p) : len(p) + len(a)] = torch.tensor(a)
                mask[i, : len(p) + len(a)] = 1
            loss = model(input_ids=ids.to(device), attention_mask=mask.to(device), labels=labels.to(device)).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            bar.set_postfix(loss=f"{loss.item():.3f}")
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "COMPLETE").write_text("ok")
        give_umask_modes(tmp)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    return str(out)
