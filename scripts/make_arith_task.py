"""Writes the project's own verifiable RL task: everyday arithmetic word problems with integer answers.

    python scripts/make_arith_task.py [--out-dir data] [--seed 13] [--train 512] [--test 64]

Every row is {"instruction": problem + ASK, "answer": "<integer>"} (alpaca, registered as arith_train /
arith_test in data/dataset_info.json; the `answer` column reaches the accuracy reward). The problems are
mostly one operation on small numbers, about a quarter two operations, so that a 135M chat model solves
some before training and a reward has something to reinforce: the built-in SmolLM2-135M-Instruct gets about
a quarter of the held-out problems right greedily, 17% of its samples at temperature 0.7. The output is a
pure function of the seed and the sizes: tests/data/test_arith_task.py rebuilds it and compares the
committed files byte for byte.
The held-out split shares no (template, numbers) pair with the training split, whatever the names.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

ASK = "Give the final answer as a number on the last line."
TWO_STEP_SHARE = 0.25
NAMES = ["Ana", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kemi", "Liam",
         "Mia", "Noah", "Olga", "Priya", "Quinn", "Rosa", "Sam", "Tara", "Umar", "Vera", "Wen", "Yusuf", "Zoe"]


def n(rng: random.Random, lo: int, hi: int) -> int:
    return rng.randint(lo, hi)


# Each template: (wording with {fields}, a sampler returning the numeric fields and the answer).
# Samplers draw small numbers (counts of 2 or more, so the wording stays plural) and build divisions from
# their quotient, so every answer is a whole number.
Template = tuple[str, Callable[[random.Random], dict[str, int]]]


def _add(lo=2, hi=20):
    def sample(r):
        a, b = n(r, lo, hi), n(r, lo, hi)
        return {"a": a, "b": b, "answer": a + b}
    return sample


def _sub(lo=6, hi=30):
    def sample(r):
        a = n(r, lo, hi)
        b = n(r, 2, a - 1)
        return {"a": a, "b": b, "answer": a - b}
    return sample


def _mul(lo=2, hi=9):
    def sample(r):
        a, b = n(r, lo, hi), n(r, lo, hi)
        return {"a": a, "b": b, "answer": a * b}
    return sample


def _div(lo=2, hi=9):
    def sample(r):  # the total is built from the quotient, which is asked for
        quotient, divisor = n(r, lo, hi), n(r, 2, 6)
        return {"total": quotient * divisor, "b": divisor, "answer": quotient}
    return sample


def _square(r):
    a = n(r, 2, 9)
    return {"a": a, "answer": a * a}


ONE_STEP: list[Template] = [
    # shopping
    ("{name} buys {a} apples at the market and later buys {b} more. How many apples did {name} buy?", _add()),
    ("{name} has {a} dollars and spends {b} dollars on a book. How many dollars does {name} have left?", _sub()),
    ("A notebook costs {a} dollars. How many dollars do {b} notebooks cost?", _mul()),
    ("{name} pays {total} dollars for {b} identical mugs. How many dollars does one mug cost?", _div()),
    # sharing
    ("{name} shares {total} cookies equally among {b} friends. How many cookies does each friend get?", _div()),
    ("{name} packs {total} eggs into cartons that hold {b} eggs each. How many cartons does {name} fill?", _div()),
    ("There are {a} boxes with {b} pencils in each box. How many pencils are there in all?", _mul()),
    # speeds and distances
    ("A bus travels at {a} kilometers per hour for {b} hours. How many kilometers does it travel?", _mul()),
    ("A cyclist rides {total} kilometers in {b} hours at a steady speed. How many kilometers per hour is that?",
     _div()),
    ("{name} walks {a} kilometers in the morning and {b} kilometers in the evening. How many kilometers does "
     "{name} walk that day?", _add(2, 12)),
    # ages
    ("{name} is {a} years old. {other} is {b} years older than {name}. How old is {other}?", _add(3, 30)),
    ("{name} is {a} years old now. How old will {name} be in {b} years?", _add(2, 25)),
    ("{name} is {a} years old. How old was {name} {b} years ago?", _sub(8, 40)),
    # areas
    ("A rectangular garden is {a} meters long and {b} meters wide. What is its area in square meters?", _mul()),
    ("A rectangle has an area of {total} square meters and a width of {b} meters. How many meters long is it?",
     _div()),
    ("A square tile has sides of {a} centimeters. What is its area in square centimeters?", _square),
    # sums and differences of everyday counts
    ("A class has {a} boys and {b} girls. How many students are in the class?", _add()),
    ("A shelf holds {a} books. {name} takes {b} of them away. How many books are left on the shelf?", _sub()),
    ("A train leaves the station with {a} passengers. At the first stop {b} passengers get off and nobody gets "
     "on. How many passengers are still on the train?", _sub()),
    ("{name} reads {a} pages on Monday and {b} pages on Tuesday. How many pages does {name} read in the two "
     "days?", _add()),
    ("In the morning it is {a} degrees. By noon it is {b} degrees warmer. How many degrees is it at noon?",
     _add(2, 15)),
    ("{name} had {a} marbles and lost {b} of them. How many marbles does {name} have now?", _sub()),
]


def _change(r):
    a, b = n(r, 2, 5), n(r, 2, 4)
    bill = next(x for x in (10, 20, 50) if x > a * b)
    return {"a": a, "b": b, "c": bill, "answer": bill - a * b}


def _more_then_less(r):
    a, b = n(r, 5, 20), n(r, 2, 10)
    c = n(r, 1, a + b - 1)
    return {"a": a, "b": b, "c": c, "answer": a + b - c}


def _product_plus(r):
    a, b, c = n(r, 2, 6), n(r, 2, 6), n(r, 1, 10)
    return {"a": a, "b": b, "c": c, "answer": a * b + c}


def _product_minus(r):
    a, b = n(r, 2, 6), n(r, 2, 6)
    c = n(r, 2, a * b - 1)
    return {"a": a, "b": b, "c": c, "answer": a * b - c}


def _split_plus_tip(r):
    q, d, tip = n(r, 2, 9), n(r, 2, 5), n(r, 2, 5)
    return {"total": q * d, "b": d, "c": tip, "answer": q + tip}


def _twice_later(r):
    a, b = n(r, 2, 12), n(r, 2, 10)
    return {"a": a, "b": b, "answer": 2 * a + b}


TWO_STEP: list[Template] = [
    ("{name} buys {a} pens at {b} dollars each and pays with a {c} dollar bill. How many dollars of change does "
     "{name} get?", _change),
    ("{name} has {a} stickers, gets {b} more from a friend, then gives {c} to a sister. How many stickers does "
     "{name} have now?", _more_then_less),
    ("A farmer has {a} rows of carrot plants with {b} plants in each row, and then plants {c} more. How many "
     "carrot plants are there now?", _product_plus),
    ("A baker makes {a} trays of muffins with {b} muffins on each tray and sells {c} of them. How many muffins "
     "are left?", _product_minus),
    ("{b} friends split a bill of {total} dollars equally, and each also leaves a tip of {c} dollars. How many "
     "dollars does each friend pay?", _split_plus_tip),
    ("{name} is {a} years old. {other} is twice as old as {name}. How old will {other} be in {b} years?",
     _twice_later),
    ("A room is {a} meters long and {b} meters wide. A rug covers {c} square meters of it. How many square "
     "meters of floor are not covered?", _product_minus),
]


def make_problem(rng: random.Random) -> tuple[tuple, dict[str, str]]:
    """One problem: its identity (template and numbers, names aside) and its row."""
    two_step = rng.random() < TWO_STEP_SHARE
    table = TWO_STEP if two_step else ONE_STEP
    index = rng.randrange(len(table))
    wording, sample = table[index]
    fields = sample(rng)
    name, other = rng.sample(NAMES, 2)
    text = wording.format(name=name, other=other, **fields)
    key = (two_step, index, tuple(sorted(fields.items())))
    return key, {"instruction": f"{text} {ASK}", "answer": str(fields["answer"])}


def make_splits(seed: int, n_train: int, n_test: int) -> tuple[list[dict], list[dict]]:
    """Distinct problems (by template and numbers), the first n_test held out."""
    rng = random.Random(seed)
    seen: set[tuple] = set()
    rows: list[dict] = []
    while len(rows) < n_train + n_test:
        key, row = make_problem(rng)
        if key not in seen:
            seen.add(key)
            rows.append(row)
    return rows[n_test:], rows[:n_test]


def render(rows: list[dict]) -> str:
    return json.dumps(rows, indent=2, ensure_ascii=False) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=str(Path(__file__).resolve().parents[1] / "data"))
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--train", type=int, default=512)
    parser.add_argument("--test", type=int, default=64)
    args = parser.parse_args()
    train, test = make_splits(args.seed, args.train, args.test)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("arith_train", train), ("arith_test", test)):
        (out / f"{name}.json").write_text(render(rows), encoding="utf-8")
        print(f"{out / name}.json: {len(rows)} problems")


if __name__ == "__main__":
    main()
