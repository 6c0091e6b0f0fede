"""Write examples/data/word_problems.jsonl: templated one-step arithmetic word problems.

    python examples/data/make_word_problems.py [--rows 400] [--seed 0] [--out PATH]

Each line is {"id", "question", "answer"}; the answer is the number as text. The
problems are short because the quick-start tokenizer is character level: a few words,
two numbers up to 5 and one operation named by the verb (gets/buys/finds add,
loses/sells/gives away subtract), so a tiny model can learn them on a CPU in minutes.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ["Ann", "Bob", "Sam", "Eva", "Max", "Zoe", "Tom", "Lia"]
ITEMS = ["apples", "pens", "cards", "eggs", "books", "coins"]
ADD = ["gets", "buys", "finds"]
SUB = ["loses", "sells", "gives away"]


def problem(rng: random.Random, max_n: int, p_add: float) -> tuple[str, int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    if rng.random() < p_add:
        a, b = rng.randint(0, max_n), rng.randint(0, max_n)
        return f"{name} has {a} {item} and {rng.choice(ADD)} {b} more. How many {item} now?", a + b
    a = rng.randint(1, max_n)
    b = rng.randint(0, a)
    return f"{name} has {a} {item} and {rng.choice(SUB)} {b}. How many {item} now?", a - b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max", type=int, default=5, help="largest number in a problem")
    ap.add_argument("--p-add", type=float, default=0.5, help="share of addition problems (the rest subtract)")
    ap.add_argument("--out", default=str(Path(__file__).with_name("word_problems.jsonl")))
    args = ap.parse_args()
    rng = random.Random(args.seed)
    with open(args.out, "w") as f:
        for i in range(args.rows):
            q, ans = problem(rng, args.max, args.p_add)
            f.write(json.dumps({"id": f"wp-{i}", "question": q, "answer": str(ans)}) + "\n")
    print(f"wrote {args.rows} problems to {args.out}")


if __name__ == "__main__":
    main()
