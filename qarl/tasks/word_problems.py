"""Small GSM8K-style and MATH-style datasets, made locally: the dataset task's two answer conventions on files
a machine without a hub can write, for the tests and the chat-template benchmark.

  GSM8K-style  {"question": "Ann has 23 pens and buys 45 more. How many pens does Ann have now?",
                "answer": "23 + 45 = 68\\n#### 68"}                         reward: gsm8k
  MATH-style   {"problem": "Compute $23 + 45$.", "solution": "$23 + 45 = \\\\boxed{68}$"}   reward: boxed_math
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
