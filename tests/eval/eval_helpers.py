"""Data for the eval tests: a tiny multiple-choice benchmark and a tiny alpaca dataset."""

from __future__ import annotations

import csv
import json
from pathlib import Path

# subject -> split -> rows (question, A, B, C, D, answer)
TOY_ROWS = {
    "colors": {
        "test": [("What color is the sky?", "Blue", "Green", "Red", "Black", "A"),
                 ("What color is grass?", "Pink", "Green", "White", "Gray", "B"),
                 ("What color is snow?", "Brown", "Orange", "White", "Purple", "C")],
        "dev": [("What color is coal?", "Black", "Yellow", "Blue", "Red", "A"),
                ("What color is a lemon?", "Blue", "Yellow", "Black", "Green", "B")],
    },
    "numbers": {
        "test": [("How many legs does a dog have?", "Two", "Six", "Eight", "Four", "D"),
                 ("What is 1 + 2?", "3", "4", "5", "6", "A")],
        "dev": [("What is 2 + 2?", "3", "4", "5", "6", "B")],
    },
}


def write_csv(path: Path, rows: list[tuple]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as f:
        csv.writer(f, lineterminator="\n").writerows(rows)
    return path


def write_jsonl(path: Path, rows: list[tuple]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    keys = ("question", "A", "B", "C", "D", "answer")
    path.write_text("".join(json.dumps(dict(zip(keys, r, strict=True))) + "\n" for r in rows), encoding="utf-8")
    return path


ALPACA_ROWS = [
    {"instruction": "Say hello.", "input": "", "output": "Hello there!"},
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "2 + 3 = 5, so the sum is five."},
    {"instruction": "Name a fruit.", "input": "", "output": "An apple."},
]
