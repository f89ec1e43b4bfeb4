"""The graded word-problem levels (qarl/tasks/word_problems.py): distinct questions, disjoint splits, solutions whose
steps are the question's arithmetic, a reference the gsm8k verifier accepts, and the files the SmolLM2 recipes ship
equal to what the generator writes (so they cannot drift from it)."""

from __future__ import annotations

import json
import operator
import re
from pathlib import Path

import pytest

from qarl.config import RecipeConfig, load_recipe
from qarl.rewards import resolve_reward
from qarl.tasks.word_problems import LEVELS, write_graded_problems

ROOT = Path(__file__).resolve().parents[2]
OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
# the shipped files: recipes/qa_grpo_smollm2.yaml's task data, and the arguments that wrote them
SHIPPED = ("recipes/data/smollm2_mix", "mix", 2000, 1000, 0)


def _rows(path: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("level", [*LEVELS, "mix"])
def test_a_level_is_distinct_disjoint_and_its_solutions_are_its_arithmetic(tmp_path, level):
    files = write_graded_problems(tmp_path, level, num_train=2000, num_eval=1000, seed=3)
    train, test = _rows(files["train"]), _rows(files["test"])
    questions = [r["question"] for r in train + test]
    assert (len(train), len(test)) == (2000, 1000) and len(set(questions)) == 3000
    for r in train + test:
        given = [int(n) for n in re.findall(r"\d+", r["question"])]
        *lines, final = r["answer"].split("\n")
        steps = [re.fullmatch(r"(\d+) ([-+*]) (\d+) = (-?\d+)", line).groups() for line in lines]
        results = [int(out) for *_, out in steps]
        # the first step takes the question's first two numbers, a second step the first result and the third
        assert [int(steps[0][0]), int(steps[0][2]), *(int(s[2]) for s in steps[1:])] == given
        assert all(int(s[0]) == prev for s, prev in zip(steps[1:], results))
        assert all(OPS[op](int(a), int(b)) == int(out) >= 0 for a, op, b, out in steps)
        assert final == f"#### {results[-1]}"


def test_the_gsm8k_verifier_takes_the_reference_and_refuses_a_wrong_number(tmp_path):
    rows = _rows(write_graded_problems(tmp_path, "mix", num_train=50, num_eval=50)["test"])
    answers = [r["answer"] for r in rows]
    wrong = [re.sub(r"#### (\d+)", lambda m: f"#### {int(m.group(1)) + 1}", a) for a in answers]
    gsm8k = resolve_reward("gsm8k")
    assert gsm8k(answers, answers) == [1.0] * len(rows) and gsm8k(wrong, answers) == [0.0] * len(rows)


def test_the_shipped_files_are_the_generators_and_the_recipe_reads_them(tmp_path):
    directory, level, num_train, num_eval, seed = SHIPPED
    task = load_recipe(ROOT / "recipes/qa_grpo_smollm2.yaml", schema=RecipeConfig).task
    assert (task.train_data, task.eval_data) == (f"{directory}/train.jsonl", f"{directory}/test.jsonl")
    fresh = write_graded_problems(tmp_path, level, num_train=num_train, num_eval=num_eval, seed=seed)
    for split, path in fresh.items():
        assert (ROOT / directory / f"{split}.jsonl").read_bytes() == path.read_bytes()
