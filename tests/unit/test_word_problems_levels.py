"""The graded word-problem levels (qarl/tasks/word_problems.py): distinct questions, disjoint splits, solutions whose
steps are the question's arithmetic, a reference the gsm8k verifier accepts, and the files the SmolLM2 recipes ship
equal to what the generator writes (so they cannot drift from it). The transfer split: disjoint from training on the
template level (phrasings, names, objects, number ranges, distractors, three steps), not only question by question."""

from __future__ import annotations

import json
import operator
import re
from collections import Counter
from pathlib import Path

import pytest

from qarl.config import RecipeConfig, load_recipe
from qarl.rewards import resolve_reward
from qarl.tasks.word_problems import (GRADED_NAMES, GRADED_THINGS, LEVELS, TRAINING_TEMPLATES, TRANSFER_KINDS,
                                      TRANSFER_NAMES, TRANSFER_TEMPLATES, TRANSFER_THINGS, write_graded_problems,
                                      write_transfer_problems)
from tests.conftest import REPO

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
    task = load_recipe(REPO / "recipes/qa_grpo_smollm2.yaml", schema=RecipeConfig).task
    assert (task.train_data, task.eval_data) == (f"{directory}/train.jsonl", f"{directory}/test.jsonl")
    fresh = write_graded_problems(tmp_path, level, num_train=num_train, num_eval=num_eval, seed=seed)
    for split, path in fresh.items():
        assert (REPO / directory / f"{split}.jsonl").read_bytes() == path.read_bytes()


# -- the transfer split -----------------------------------------------------------------------------------------------
# words a template of each split may share: articles, prepositions, pronouns, auxiliaries, quantifiers
FUNCTION_WORDS = {"a", "and", "does", "each", "how", "in", "many", "of", "on", "out", "the", "them", "then", "with"}
TRANSFER = REPO / "recipes/data/smollm2_mix/transfer.jsonl"


def _words(template: str) -> list[str]:
    """A template's words, lower case, placeholders ({n}, {a}, ...) kept as words, punctuation dropped."""
    return re.sub(r"[^\w{} ]", " ", template.lower()).split()


def _ngrams(template: str, n: int = 4) -> set[tuple[str, ...]]:
    words = _words(template)
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def _matcher(template: str) -> re.Pattern:
    """A regular expression that any question written from `template` matches, whatever its names and numbers."""
    parts = re.split(r"(\{\w\})", template)
    return re.compile("".join(r"[A-Za-z]+" if p in ("{n}", "{t}") else r"\d+" if re.fullmatch(r"\{\w\}", p)
                              else re.escape(p) for p in parts))


def _given(row: dict[str, str]) -> list[tuple[str, int]]:
    """The operations and operands a problem's question gives: both of the first step's, then each later step's
    second (its first is the step before's result)."""
    given = []
    for i, line in enumerate(row["answer"].split("\n")[:-1]):
        a, op, b, _ = re.fullmatch(r"(\d+) ([-+*]) (\d+) = (\d+)", line).groups()
        given += [(op, int(x)) for x in ((a, b) if i == 0 else (b,))]
    return given


def test_no_transfer_template_shares_a_phrasing_a_name_or_an_object_with_training():
    """Template level: no word 4-gram of a transfer template is in any training template (names and numbers as
    placeholders), the words both share are function words only, and the names and objects are other ones."""
    training = set().union(*(_ngrams(t) for t in TRAINING_TEMPLATES))
    transfer = [t for templates in TRANSFER_TEMPLATES.values() for t in templates]
    assert len(transfer) >= 20
    for template in transfer:
        assert not _ngrams(template) & training, template
    shared = {w for t in TRAINING_TEMPLATES for w in _words(t)} & {w for t in transfer for w in _words(t)}
    assert {w for w in shared if not re.fullmatch(r"\{\w\}", w)} <= FUNCTION_WORDS
    assert not set(TRANSFER_NAMES) & set(GRADED_NAMES) and not set(TRANSFER_THINGS) & set(GRADED_THINGS)


def test_the_shipped_transfer_split_is_the_generators_and_disjoint_from_training(tmp_path):
    """Data level, on the shipped files: the transfer file is what the generator writes, 1,000 distinct problems whose
    solutions are their arithmetic; no transfer question is written from a training template and no training or test
    question from a transfer one; every problem gives an operation an operand beyond any the levels can give it;
    the distractor kinds' questions hold one number the solution does not use, the three-step kinds take three."""
    assert TRANSFER.read_bytes() == write_transfer_problems(tmp_path).read_bytes()
    transfer = _rows(TRANSFER)
    directory = REPO / SHIPPED[0]
    trained = _rows(directory / "train.jsonl") + _rows(directory / "test.jsonl")
    assert len(transfer) == 1000 and len({r["question"] for r in transfer}) == 1000
    training_matchers = [_matcher(t) for t in TRAINING_TEMPLATES]
    transfer_matchers = [_matcher(t) for templates in TRANSFER_TEMPLATES.values() for t in templates]
    assert not any(m.fullmatch(r["question"]) for r in transfer for m in training_matchers)
    assert not any(m.fullmatch(r["question"]) for r in trained for m in transfer_matchers)
    largest = {"+": 20, "-": 80, "*": 12}  # the largest operand any level gives each operation (two_step's c: 80)
    assert all(x <= largest[op] for r in trained for op, x in _given(r))
    kinds = {r["template"].split("/")[0] for r in transfer}
    assert kinds == set(TRANSFER_KINDS)
    for r in transfer:
        kind, index = r["template"].split("/")
        assert _matcher(TRANSFER_TEMPLATES[kind][int(index)]).fullmatch(r["question"])
        *lines, final = r["answer"].split("\n")
        steps = [re.fullmatch(r"(\d+) ([-+*]) (\d+) = (\d+)", line).groups() for line in lines]
        assert all(OPS[op](int(a), int(b)) == int(out) >= 0 for a, op, b, out in steps)
        assert final == f"#### {steps[-1][3]}"
        assert all(step[0] == before[3] for step, before in zip(steps[1:], steps)), r  # a chain: _given reads it so
        assert any(x > largest[op] for op, x in _given(r)), r
        used = sorted(x for _, x in _given(r))
        numbers = sorted(int(n) for n in re.findall(r"\d+", r["question"]))
        extra = list((Counter(numbers) - Counter(used)).elements())
        assert len(extra) == (1 if kind.startswith("distractor") else 0), r
        assert len(steps) == (3 if kind == "three_mul_add_sub" else 2 if kind.startswith("three") else 1), r
    assert resolve_reward("gsm8k")([r["answer"] for r in transfer], [r["answer"] for r in transfer]) == [1.0] * 1000


def test_the_smollm2_recipe_reads_the_transfer_split():
    task = load_recipe(REPO / "recipes/qa_grpo_smollm2.yaml", schema=RecipeConfig).task
    assert task.transfer_data == f"{SHIPPED[0]}/transfer.jsonl"


def test_a_task_has_train_test_and_optionally_transfer_splits(tmp_path):
    """The dataset task reads task.transfer_data beside its other splits and refuses one that repeats a training
    prompt; the embedded arithmetic task has none. eval_splits names what an evaluation scores."""
    from qarl.config import ConfigError, TaskConfig
    from qarl.tasks import ArithmeticTask, DatasetTask, eval_splits

    directory = REPO / SHIPPED[0]
    files = dict(name="dataset", train_data=str(directory / "train.jsonl"), eval_data=str(directory / "test.jsonl"),
                 prompt_column="question", answer_column="answer")
    task = DatasetTask(TaskConfig(**files, transfer_data=str(TRANSFER)))
    assert (len(task.train), len(task.eval), len(task.transfer)) == (2000, 1000, 1000)
    assert task.transfer[0].prompt == _rows(TRANSFER)[0]["question"]
    assert {k: len(v) for k, v in eval_splits(task, 100, 50).items()} == {"test": 100, "transfer": 50}
    assert list(eval_splits(task, 100, 0)) == ["test"]
    assert DatasetTask(TaskConfig(**files)).transfer == []
    leaky = tmp_path / "leaky.jsonl"
    leaky.write_text(TRANSFER.read_text() + (directory / "train.jsonl").read_text().splitlines()[7] + "\n")
    with pytest.raises(ConfigError, match=r"repeats training prompts of task.train_data \(1, e.g."):
        DatasetTask(TaskConfig(**files, transfer_data=str(leaky)))
    arithmetic = ArithmeticTask(num_train=20, num_eval=10)
    assert arithmetic.transfer == [] and list(eval_splits(arithmetic, 5, 100)) == ["test"]
