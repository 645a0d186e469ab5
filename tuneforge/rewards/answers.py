"""Does a completion's final answer equal the right one? The comparison behind the accuracy reward.

The final answer is read after any reasoning (`</think>`): the last `\\boxed{...}`, else the text after the
last `####` (GSM8K), else the whole text. The right answer is read the same way, so a GSM8K or MATH
solution column works as it is. When the right answer is a number, the completion's answer is its last
number and the two compare as exact fractions ("42" = "42.0", "1,234" = "1234", "3/4" = "0.75" =
"\\frac{3}{4}"); otherwise they compare as text, ignoring case, spacing, markup and trailing punctuation.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any

# thousands separators only in groups of three, so "1,2,3" is three numbers, "1,234" one
NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?|-?\.\d+")
LATEX_FRACTION = re.compile(r"(-?)\\[dt]?frac\{\s*(-?[\d.]+)\s*\}\{\s*(-?[\d.]+)\s*\}")
SLASH_FRACTION = re.compile(r"(-?[\d.]+)\s*/\s*(-?[\d.]+)")
ANSWER_PHRASE = re.compile(r"answer(?:\s+is)?\s*[:：]?\s*(.+)", re.IGNORECASE)
LATEX_TEXT = re.compile(r"\\(?:text|mathrm|textbf)\{([^{}]*)\}")
EDGE_CHARACTERS = " \t\n.,;:!?。*_`'\"$"


def is_missing(answer: Any) -> bool:
    """No right answer: None, an empty text or list, or a float NaN (a missing value in a table)."""
    if answer is None:
        return True
    if isinstance(answer, float):
        return math.isnan(answer)
    if isinstance(answer, (list, tuple)):
        return all(is_missing(a) for a in answer)
    return not str(answer).strip()


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (braces balanced), or None."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    opening = text.find("{", start)
    if opening < 0:
        return None
    depth = 0
    for i in range(opening, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[opening + 1 : i]
    return None  # never closed: a completion cut off mid-answer


def answer_part(text: str) -> str:
    """The part of text that states its final answer (see the module docstring)."""
    text = text.rsplit("</think>", 1)[-1]
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        return text.rsplit("####", 1)[1]
    return text


def to_number(text: str) -> Fraction | None:
    """text as an exact number when all of it is one (an integer, decimal, a/b or \\frac{a}{b}), else None."""
    s = text.replace("−", "-").replace("\\!", "").replace("\\$", "").replace("$", "").replace("%", "")
    s = s.replace(",", "").strip().rstrip(".").strip()
    try:
        if m := LATEX_FRACTION.fullmatch(s):
            value = Fraction(m[2]) / Fraction(m[3])
            return -value if m[1] else value
        if m := SLASH_FRACTION.fullmatch(s):
            return Fraction(m[1]) / Fraction(m[2])
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def stated_number(completion: str) -> Fraction | None:
    """The number a completion gives as its answer: its answer part when that is a number, else the last
    number written in it."""
    part = answer_part(completion).replace("−", "-")
    value = to_number(part)
    if value is not None:
        return value
    numbers = NUMBER.findall(part)
    return to_number(numbers[-1]) if numbers else None


def normalized(text: str) -> str:
    text = LATEX_TEXT.sub(r"\1", text)
    return " ".join(text.split()).strip(EDGE_CHARACTERS).lower()


def stated_texts(completion: str) -> list[str]:
    """The normalized texts a completion may give as its answer: its answer part, what follows its last
    "answer is" / "answer:", and its last line."""
    part = answer_part(completion)
    candidates = [part]
    phrases = ANSWER_PHRASE.findall(part)
    if phrases:
        candidates.append(phrases[-1])
    lines = [line for line in part.splitlines() if line.strip()]
    if lines:
        candidates.append(lines[-1])
    return [normalized(c) for c in candidates]


def is_correct(completion: str, answer: Any) -> bool:
    """Whether completion's final answer equals answer (a value, or a list of accepted values)."""
    if isinstance(answer, (list, tuple)):
        return any(is_correct(completion, a) for a in answer if not is_missing(a))
    right = answer_part(str(answer))
    number = to_number(right)
    if number is not None:
        return stated_number(completion) == number
    return normalized(right) in stated_texts(completion)
