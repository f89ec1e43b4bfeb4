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
"""

from __future__ import annotations

import json
import random
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


def _add1(rng: random.Random) -> tuple[str, dict[str, int], list[Step]]:
    a, b = rng.randint(2, 20), rng.randint(2, 20)
    return rng.choice(("{n} has {a} {t} and buys {b} more. How many {t} does {n} have now?",
                       "{n} had {a} {t}. A friend gave {n} {b} more. How many {t} does {n} have now?",
                       "There are {a} {t} in a box. {n} puts in {b} more. How many {t} are in the box now?")
                      ), {"a": a, "b": b}, [(a, "+", b, a + b)]


def _sub1(rng: random.Random) -> tuple[str, dict[str, int], list[Step]]:
    a = rng.randint(5, 30)
    b = rng.randint(1, a - 1)
    return rng.choice(("{n} has {a} {t} and gives {b} away. How many {t} does {n} have left?",
                       "{n} had {a} {t} and lost {b} of them. How many {t} does {n} have now?",
                       "There are {a} {t} in a box. {n} takes out {b}. How many {t} are left in the box?")
                      ), {"a": a, "b": b}, [(a, "-", b, a - b)]


def _mul1(rng: random.Random) -> tuple[str, dict[str, int], list[Step]]:
    a, b = rng.randint(2, 9), rng.randint(2, 12)
    return rng.choice(("{n} has {a} bags with {b} {t} in each bag. How many {t} does {n} have in all?",
                       "{n} buys {a} packs of {t}. Each pack has {b} {t}. How many {t} does {n} buy?",
                       "A shelf has {a} rows with {b} {t} in each row. How many {t} are on the shelf?")
                      ), {"a": a, "b": b}, [(a, "*", b, a * b)]


def _two_step(rng: random.Random) -> tuple[str, dict[str, int], list[Step]]:
    kind = rng.randrange(3)
    if kind == 0:  # add, then give some away
        a, b = rng.randint(2, 20), rng.randint(2, 20)
        c = rng.randint(1, a + b - 1)
        return ("{n} has {a} {t}, buys {b} more, then gives {c} away. How many {t} does {n} have now?",
                {"a": a, "b": b, "c": c}, [(a, "+", b, a + b), (a + b, "-", c, a + b - c)])
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    if kind == 1:  # multiply, then add
        c = rng.randint(1, 20)
        return ("{n} buys {a} packs of {t} with {b} {t} in each pack and already had {c}. How many {t} does {n} "
                "have now?", {"a": a, "b": b, "c": c}, [(a, "*", b, a * b), (a * b, "+", c, a * b + c)])
    c = rng.randint(1, a * b - 1)  # multiply, then subtract
    return ("{n} has {a} bags with {b} {t} in each bag and gives {c} {t} away. How many {t} are left?",
            {"a": a, "b": b, "c": c}, [(a, "*", b, a * b), (a * b, "-", c, a * b - c)])


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


def write_graded_problems(out_dir: str | Path, level: str, num_train: int = 2000, num_eval: int = 1000,
                          seed: int = 0) -> dict[str, Path]:
    """train.jsonl and test.jsonl of `level` in `out_dir` (question, answer columns; reward gsm8k): distinct
    questions, none of the held-out ones in train; their paths by split. The same arguments write the same bytes."""
    rng, seen, rows = random.Random(seed), set(), []
    # a bound on the draws: more problems than a level holds (mul1 the fewest, 31,680) fail instead of looping forever
    for _ in range(20 * (num_train + num_eval)):
        if len(rows) == num_train + num_eval:
            break
        r = graded_row(rng, level)
        if r["question"] not in seen:
            seen.add(r["question"])
            rows.append(r)
    else:
        raise ValueError(f"level {level} has too few distinct questions for {num_train + num_eval} problems")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, part in (("train", rows[:num_train]), ("test", rows[num_train:])):
        paths[split] = out / f"{split}.jsonl"
        paths[split].write_text("".join(json.dumps(r) + "\n" for r in part))
    return paths
