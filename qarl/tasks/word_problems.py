"""Small GSM8K-style and MATH-style datasets, made locally: the dataset task's two answer conventions on files
a machine without a hub can write, for the tests and the chat-template benchmark.

  GSM8K-style  {"question": "Ann has 23 pens and buys 45 more. How many pens does Ann have now?",
                "answer": "23 + 45 = 68\\n#### 68"}                         reward: gsm8k
  MATH-style   {"problem": "Compute $23 + 45$.", "solution": "$23 + 45 = \\\\boxed{68}$"}   reward: boxed_math

Graded GSM8K-style levels (`write_graded_problems`): one or two small operations worded several ways, so a small
pretrained instruct model (SmolLM2-135M-Instruct) starts with some reward and can learn the rest in minutes of RL:

  add1      one addition, operands 2-20          sub1      one subtraction, 5-30 minus a smaller number
  mul1      single digit * 2-12                  two_step  a multiplication or an addition, then + or -
  mix       one of the four above, drawn uniformly

Their transfer split (`write_transfer_problems`): problems in templates the levels never use, to tell what RL learnt of
the task from what it learnt of its templates: other names, objects, verbs and phrasings, distractor numbers, three
steps, larger operands. Each row names its template ("kind/index"); tests/unit/test_word_problems_levels.py checks
that no template, phrasing, name, object or number range of it is in training. The shipped files:
  write_graded_problems("recipes/data/smollm2_mix", "mix")    train.jsonl, test.jsonl
  write_transfer_problems("recipes/data/smollm2_mix")         transfer.jsonl
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

NAMES = ("Ann", "Bo", "Cy", "Dee", "Eli")
THINGS = ("pens", "cards", "apples", "coins", "books")


LOW, HIGH = 10, 99  # two-digit operands: 8,100 distinct MATH-style problems


def _numbers(rng: random.Random) -> tuple[int, int]:
    return rng.randint(LOW, HIGH), rng.randint(LOW, HIGH)


def gsm8k_row(rng: random.Random) -> dict[str, str]:
    a, b = _numbers(rng)
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    return {"question": f"{name} has {a} {thing} and buys {b} more. How many {thing} does {name} have now?",
            "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}


def math_row(rng: random.Random) -> dict[str, str]:
    a, b = _numbers(rng)
    return {"problem": f"Compute ${a} + {b}$.", "solution": f"${a} + {b} = \\boxed{{{a + b}}}$"}


def write_word_problems(out_dir: str | Path, num_train: int = 400, num_eval: int = 50, seed: int = 0) -> dict[str, Path]:
    """gsm8k_{train,test}.jsonl and math_{train,test}.jsonl in `out_dir` (disjoint splits); their paths by name."""
    if num_train + num_eval > (HIGH - LOW + 1) ** 2 // 2:
        raise ValueError(f"at most {(HIGH - LOW + 1) ** 2 // 2} problems in num_train + num_eval")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for style, row in (("gsm8k", gsm8k_row), ("math", math_row)):
        rng, seen, rows = random.Random(seed), set(), []
        while len(rows) < num_train + num_eval:
            r = row(rng)
            key = next(iter(r.values()))
            if key not in seen:
                seen.add(key)
                rows.append(r)
        for split, part in (("train", rows[:num_train]), ("test", rows[num_train:])):
            path = out / f"{style}_{split}.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in part))
            paths[f"{style}_{split}"] = path
    return paths


GRADED_NAMES = ("Ann", "Bo", "Cy", "Dee", "Eli", "Fay", "Gus", "Hal", "Ivy", "Jo", "Kim", "Lou")
GRADED_THINGS = ("pens", "cards", "apples", "coins", "books", "shells", "stickers", "marbles", "eggs", "toys")
Step = tuple[int, str, int, int]  # a op b = result


# Each level's templates, named so that tests can compare them with the transfer split's (test_word_problems_levels.py)
ADD1 = ("{n} has {a} {t} and buys {b} more. How many {t} does {n} have now?",
        "{n} had {a} {t}. A friend gave {n} {b} more. How many {t} does {n} have now?",
        "There are {a} {t} in a box. {n} puts in {b} more. How many {t} are in the box now?")
SUB1 = ("{n} has {a} {t} and gives {b} away. How many {t} does {n} have left?",
        "{n} had {a} {t} and lost {b} of them. How many {t} does {n} have now?",
        "There are {a} {t} in a box. {n} takes out {b}. How many {t} are left in the box?")
MUL1 = ("{n} has {a} bags with {b} {t} in each bag. How many {t} does {n} have in all?",
        "{n} buys {a} packs of {t}. Each pack has {b} {t}. How many {t} does {n} buy?",
        "A shelf has {a} rows with {b} {t} in each row. How many {t} are on the shelf?")
TWO_STEP = ("{n} has {a} {t}, buys {b} more, then gives {c} away. How many {t} does {n} have now?",
            "{n} buys {a} packs of {t} with {b} {t} in each pack and already had {c}. How many {t} does {n} have now?",
            "{n} has {a} bags with {b} {t} in each bag and gives {c} {t} away. How many {t} are left?")
TRAINING_TEMPLATES = ADD1 + SUB1 + MUL1 + TWO_STEP  # every template of the graded levels (train and test splits)


def _add1(rng: random.Random) -> tuple[str, dict[str, int], list[Step]]:
    a, b = rng.randint(2, 20), rng.randint(2, 20)
    return rng.choice(ADD1), {"a": a, "b": b}, [(a, "+", b, a + b)]


def _sub1(rng: random.Random) -> tuple[str, dict[str, int], list[Step]]:
    a = rng.randint(5, 30)
    b = rng.randint(1, a - 1)
    return rng.choice(SUB1), {"a": a, "b": b}, [(a, "-", b, a - b)]


def _mul1(rng: random.Random) -> tuple[str, dict[str, int], list[Step]]:
    a, b = rng.randint(2, 9), rng.randint(2, 12)
    return rng.choice(MUL1), {"a": a, "b": b}, [(a, "*", b, a * b)]


def _two_step(rng: random.Random) -> tuple[str, dict[str, int], list[Step]]:
    kind = rng.randrange(3)
    if kind == 0:  # add, then give some away
        a, b = rng.randint(2, 20), rng.randint(2, 20)
        c = rng.randint(1, a + b - 1)
        return TWO_STEP[0], {"a": a, "b": b, "c": c}, [(a, "+", b, a + b), (a + b, "-", c, a + b - c)]
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    if kind == 1:  # multiply, then add
        c = rng.randint(1, 20)
        return TWO_STEP[1], {"a": a, "b": b, "c": c}, [(a, "*", b, a * b), (a * b, "+", c, a * b + c)]
    c = rng.randint(1, a * b - 1)  # multiply, then subtract
    return TWO_STEP[2], {"a": a, "b": b, "c": c}, [(a, "*", b, a * b), (a * b, "-", c, a * b - c)]


LEVELS = {"add1": _add1, "sub1": _sub1, "mul1": _mul1, "two_step": _two_step}


def graded_row(rng: random.Random, level: str) -> dict[str, str]:
    """One GSM8K-style problem of `level` (or of a level drawn uniformly for "mix"): the question and its solution,
    each step written out, ending '#### n'."""
    if level == "mix":
        level = rng.choice(list(LEVELS))
    if level not in LEVELS:
        raise ValueError(f"unknown level {level!r}; levels: {', '.join(LEVELS)}, mix")
    template, numbers, steps = LEVELS[level](rng)
    name, thing = rng.choice(GRADED_NAMES), rng.choice(GRADED_THINGS)
    return {"question": template.format(n=name, t=thing, **numbers),
            "answer": "".join(f"{a} {op} {b} = {r}\n" for a, op, b, r in steps) + f"#### {steps[-1][3]}"}


def distinct_rows(draw: Callable[[], dict[str, str]], num: int, source: str) -> list[dict[str, str]]:
    """`num` rows of `draw()` with distinct questions, in the order drawn. The draws are bounded: asking more problems
    than `source` holds (level mul1 the fewest, 31,680) fails instead of looping forever."""
    seen, rows = set(), []
    for _ in range(20 * num):
        if len(rows) == num:
            break
        row = draw()
        if row["question"] not in seen:
            seen.add(row["question"])
            rows.append(row)
    if len(rows) == num:
        return rows
    raise ValueError(f"{source} has too few distinct questions for {num} problems")


def write_graded_problems(out_dir: str | Path, level: str, num_train: int = 2000, num_eval: int = 1000,
                          seed: int = 0) -> dict[str, Path]:
    """train.jsonl and test.jsonl of `level` in `out_dir` (question, answer columns; reward gsm8k): distinct
    questions, none of the held-out ones in train; their paths by split. The same arguments write the same bytes."""
    rng = random.Random(seed)
    rows = distinct_rows(lambda: graded_row(rng, level), num_train + num_eval, f"level {level}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, part in (("train", rows[:num_train]), ("test", rows[num_train:])):
        paths[split] = out / f"{split}.jsonl"
        paths[split].write_text("".join(json.dumps(r) + "\n" for r in part))
    return paths


# -- the transfer split: what training never showed ------------------------------------------------------------------
# Other names, objects and verbs, other phrasings (no word 4-gram of a training template), distractor numbers, three
# steps, and in every problem an operand beyond any the training split gives that operation (+: above 20, -: above
# 80, *: above 12).
# A template's id is "kind/index"; each row names its template, so accuracy can be read per template.
TRANSFER_NAMES = ("Maya", "Omar", "Priya", "Leo", "Sara", "Tom", "Nina", "Raj", "Zoe", "Ben", "Lena", "Max")
TRANSFER_THINGS = ("stamps", "beads", "cookies", "pencils", "balloons", "buttons", "crayons", "candles", "tickets",
                   "seeds")
TRANSFER_TEMPLATES: dict[str, tuple[str, ...]] = {
    "add_large": (
        "{n} collected {a} {t} on Saturday and {b} {t} on Sunday. What is the total number of {t} {n} collected?",
        "At a fair, {n} won {a} {t} in the morning and {b} {t} in the evening. How many {t} did {n} win altogether?",
        "A jar held {a} {t}. {n} dropped another {b} {t} into the jar. Find the number of {t} inside the jar."),
    "sub_large": (
        "{n} printed {a} flyers and mailed {b} of them to customers. How many flyers were not mailed?",
        "A store ordered {a} {t}. By Friday, shoppers purchased {b}. What number of {t} remained in the store?",
        "{n} needs {a} {t} for a project but owns only {b}. How many extra {t} must {n} get?"),
    "mul_large": (
        "{n} filled {a} trays, and each tray holds {b} {t}. What is the total number of {t} on the trays?",
        "{n} saves {b} {t} every week. How many {t} will {n} save in {a} weeks?",
        "A truck carries {a} crates, and every crate contains {b} {t}. Find how many {t} the truck carries."),
    "distractor_add": (
        "{n} is {d} years old. This month {n} sold {a} {t} at school and {b} {t} online. How many {t} did {n} sell "
        "this month?",
        "A bus leaves at {d} minutes past nine. Before it leaves, {n} loads {a} {t} and then {b} {t} onto it. What "
        "is the total number of {t} loaded onto the bus?"),
    "distractor_sub": (
        "{n} lives {d} miles from town. {n} baked {a} muffins and the family ate {b}. How many muffins remain "
        "uneaten?",
        "A classroom with {d} desks got {a} {t}. The teacher handed out {b} {t}. What number of {t} does the teacher "
        "still keep?"),
    "distractor_mul": (
        "{n} spent {d} minutes at the market and picked up {a} cartons that hold {b} {t} apiece. How many {t} did "
        "{n} pick up?",
        "It is {d} degrees outside. A gardener plants {a} beds, putting {b} bulbs into every bed. What is the total "
        "number of bulbs the gardener plants?"),
    "three_mul_add_sub": (
        "{n} fills {a} crates with {b} {t} apiece, adds {c} loose {t}, and then donates {d}. What number of {t} "
        "does {n} end up with?",
        "A warehouse receives {a} cartons holding {b} {t} each, then gets another {c} {t}, and ships out {d} {t}. "
        "Find how many {t} the warehouse holds after that."),
    "three_add": (
        "{n} counted {a} {t} on Monday, {b} on Tuesday and {c} on Wednesday. What was the total count of {t} over "
        "the three days?",
        "Three classes collected {t}: the first class {a}, the second {b} and the third {c}. Altogether, how many "
        "{t} did the classes collect?"),
    "three_add_mul": (
        "{n} makes gift sets: each set gets {a} red {t} and {b} blue {t}. What is the total number of {t} in {c} "
        "sets?",
        "A teacher orders {a} large {t} and {b} small {t} for each of {c} classrooms. Find the number of {t} the "
        "teacher orders."),
    "three_sub_sub": (
        "A library owned {a} novels. It donated {b} in March and sold {c} in April. How many novels did the library "
        "own after April?",
        "{n} started a trip with {a} {t}, used {b} on the first day and {c} on the second. What number of {t} "
        "remained at the end?"),
}

TransferKind = Callable[[random.Random], tuple[dict[str, int], list[Step]]]  # a kind's numbers and solution steps


def _add_large(rng: random.Random) -> tuple[dict[str, int], list[Step]]:
    a, b = rng.randint(31, 99), rng.randint(31, 99)
    return {"a": a, "b": b}, [(a, "+", b, a + b)]


def _sub_large(rng: random.Random) -> tuple[dict[str, int], list[Step]]:
    a = rng.randint(81, 199)
    b = rng.randint(11, a - 1)
    return {"a": a, "b": b}, [(a, "-", b, a - b)]


def _mul_large(rng: random.Random) -> tuple[dict[str, int], list[Step]]:
    a, b = rng.randint(2, 6), rng.randint(13, 30)
    return {"a": a, "b": b}, [(a, "*", b, a * b)]


def _with_distractor(kind: TransferKind) -> TransferKind:
    """`kind` with a number in the question that the solution does not use ({d})."""
    def draw(rng: random.Random) -> tuple[dict[str, int], list[Step]]:
        numbers, steps = kind(rng)
        return {**numbers, "d": rng.randint(5, 60)}, steps

    return draw


def _three_mul_add_sub(rng: random.Random) -> tuple[dict[str, int], list[Step]]:
    a, b, c = rng.randint(2, 6), rng.randint(13, 25), rng.randint(31, 60)
    d = rng.randint(5, a * b + c - 1)
    return {"a": a, "b": b, "c": c, "d": d}, [(a, "*", b, a * b), (a * b, "+", c, a * b + c),
                                              (a * b + c, "-", d, a * b + c - d)]


def _three_add(rng: random.Random) -> tuple[dict[str, int], list[Step]]:
    a, b, c = rng.randint(31, 99), rng.randint(31, 99), rng.randint(31, 99)
    return {"a": a, "b": b, "c": c}, [(a, "+", b, a + b), (a + b, "+", c, a + b + c)]


def _three_add_mul(rng: random.Random) -> tuple[dict[str, int], list[Step]]:
    a, b, c = rng.randint(31, 60), rng.randint(2, 19), rng.randint(2, 5)
    return {"a": a, "b": b, "c": c}, [(a, "+", b, a + b), (a + b, "*", c, (a + b) * c)]


def _three_sub_sub(rng: random.Random) -> tuple[dict[str, int], list[Step]]:
    a = rng.randint(100, 200)
    b = rng.randint(11, a // 2)
    c = rng.randint(11, a - b - 1)
    return {"a": a, "b": b, "c": c}, [(a, "-", b, a - b), (a - b, "-", c, a - b - c)]


TRANSFER_KINDS: dict[str, TransferKind] = {
    "add_large": _add_large, "sub_large": _sub_large, "mul_large": _mul_large,
    "distractor_add": _with_distractor(_add_large), "distractor_sub": _with_distractor(_sub_large),
    "distractor_mul": _with_distractor(_mul_large), "three_mul_add_sub": _three_mul_add_sub,
    "three_add": _three_add, "three_add_mul": _three_add_mul, "three_sub_sub": _three_sub_sub,
}


def transfer_row(rng: random.Random) -> dict[str, str]:
    """One transfer problem: a kind drawn uniformly, one of its templates, its numbers; the question, its solution
    (each step written out, ending '#### n', as the graded levels') and its template's id."""
    kind = rng.choice(list(TRANSFER_KINDS))
    index = rng.randrange(len(TRANSFER_TEMPLATES[kind]))
    numbers, steps = TRANSFER_KINDS[kind](rng)
    name, thing = rng.choice(TRANSFER_NAMES), rng.choice(TRANSFER_THINGS)
    return {"question": TRANSFER_TEMPLATES[kind][index].format(n=name, t=thing, **numbers),
            "answer": "".join(f"{a} {op} {b} = {r}\n" for a, op, b, r in steps) + f"#### {steps[-1][3]}",
            "template": f"{kind}/{index}"}


def write_transfer_problems(out_dir: str | Path, num: int = 1000, seed: int = 0) -> Path:
    """transfer.jsonl in `out_dir`: `num` distinct transfer problems (question, answer, template columns; reward
    gsm8k), none in a template, phrasing or number range of the graded levels'. The same arguments write the same
    bytes."""
    rng = random.Random(seed)
    rows = distinct_rows(lambda: transfer_row(rng), num, "the transfer templates")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "transfer.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
