"""The dataset task end to end on its two answer conventions, chat-formatted by the embedded tokenizer's template:
a GSM8K-style file (question, answer ending `#### n`, reward gsm8k) and a MATH-style one (problem, solution with
`\\boxed{n}`, reward boxed_math), each a warm start then QA-GRPO steps with real vLLM and ModelOpt. The GSM8K-style
run also has a transfer split (evaluated beside the test split, each with its hygiene) and DAPO's overlong
punishment beside masked truncated completions, from its second step (trainer.soft_overlong_start_step=1)."""

from __future__ import annotations

import subprocess

import pytest

from qarl.metrics import read_metrics
from qarl.tasks.word_problems import write_transfer_problems, write_word_problems
from tests.loops import GRPO

# style: (prompt column, answer column, reward, eval.every); the MATH-style run has no held-out evaluation (eval.every=0)
STYLES = {"gsm8k": ("question", "answer", "gsm8k", 100), "math": ("problem", "solution", "boxed_math", 0)}
HYGIENE = ("accuracy", "parse_rate", "truncation_rate", "stop_rate", "mean_length")


@pytest.mark.parametrize("style", ["gsm8k", pytest.param("math", marks=pytest.mark.slow)])  # the boxed reward: test_rewards.py
def test_a_chat_formatted_word_problem_run_trains_with_its_reward(tmp_path, style):
    files = write_word_problems(tmp_path / "data", num_train=200, num_eval=8)
    prompt, answer, reward, eval_every = STYLES[style]
    run_dir = tmp_path / style
    extra = [f"task.transfer_data={write_transfer_problems(tmp_path / 'data', num=8)}", "eval.num_transfer_prompts=8",
             "trainer.soft_overlong_tokens=8", "trainer.soft_overlong_start_step=1",
             "trainer.mask_truncated_completions=true"] if style == "gsm8k" else []
    subprocess.run(GRPO.command(
        run_dir, "task.name=dataset", f"task.train_data={files[style + '_train']}",
        f"task.eval_data={files[style + '_test']}", f"task.prompt_column={prompt}", f"task.answer_column={answer}",
        f"trainer.rewards=[{{name: {reward}}}]", "trainer.steps=2", "checkpoint.every=2", f"eval.every={eval_every}",
        "eval.num_prompts=8", "warm_start.steps=20", "policy.generation.max_new_tokens=24",
        "policy.generation.max_model_len=192", *extra), check=True, timeout=600)
    rows = read_metrics(run_dir / "metrics.jsonl")
    for r in rows[:2]:
        assert 0.0 <= r[f"reward/{reward}"] <= 1.0 and r["completion/mean_length"] > 0
    if eval_every:  # at step 0 and after the last step, on both splits
        assert [r["step"] for r in rows] == [0, 1, 2]
        for r in (rows[0], rows[2]):
            for prefix in ("eval", "eval_transfer"):
                assert 0.0 <= r[f"{prefix}/accuracy"] <= r[f"{prefix}/parse_rate"] <= 1.0
                assert r[f"{prefix}/truncation_rate"] + r[f"{prefix}/stop_rate"] == pytest.approx(1.0)
                assert 0 < r[f"{prefix}/mean_length"] <= 24
        # the punishment, from step 1 on: -1 for each truncated completion, a share of it inside the 8-token buffer
        assert rows[0]["reward/soft_overlong"] == 0.0
        assert rows[0]["reward/mean"] == pytest.approx(rows[0]["reward/gsm8k"], abs=1e-6)
        assert -1.0 <= rows[1]["reward/soft_overlong"] <= -rows[1]["completion/truncated_frac"] + 1e-6
        punished = rows[1]["reward/gsm8k"] + rows[1]["reward/soft_overlong"]
        assert rows[1]["reward/mean"] == pytest.approx(punished, abs=1e-5)
    else:
        assert [r["step"] for r in rows] == [0, 1] and not any("eval/accuracy" in r for r in rows)
