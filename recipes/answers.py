"""Final answers of maths completions: where the answer is, what number it is, whether it was
written in the requested format. Pure functions over strings.

Where, in order of preference (the first rule that finds a number wins):
1. the last `\\boxed{...}` (nested braces allowed);
2. the rest of the line after the last `####` (GSM8K's convention);
3. the rest of the sentence after the last "answer is" / "answer:";
4. the last number anywhere.
In the span of rules 1-3 the answer is its first number, or, when the span is an equation
("#### 6 + 3 = 9", "the answer is 3 + 4 = 7"), the first number after its last "=".

A rule whose marker is there but holds no number (`\\boxed{x}`, a bare `####`) falls through to the
next, so a half-formatted answer is still read the way a lenient grader reads it.
"""

from __future__ import annotations

import re
from decimal import Decimal
from fractions import Fraction

# A number as models write it: "1,234" (groups of three), "-5", "$12.50", "12.0". Not digits glued to
# letters or after a dot ("H2O", "x2", the "5" of ".5"); a minus only where it cannot be subtraction
# ("8-3" is 8 and 3).
NUMBER = re.compile(r"(?<![A-Za-z\d.$])(?:(?<![\w)\]])-)?\$?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?![\d])")
_WRITTEN = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")  # NUMBER, whole, "$" removed
_ANSWER_IS = re.compile(r"answer\s*(?:is|was|:|=)\s*:?[\s*$]*", re.IGNORECASE)
_FORMATS = {
    "hashes": "Give the final answer as a number after ####.",
    "boxed": "Put the final answer, a number, in \\boxed{}.",
}


def _first_number(text: str) -> str | None:
    m = NUMBER.search(text)
    return m.group(0).replace("$", "") if m else None


def last_boxed(text: str) -> str | None:
    """The contents of the last `\\boxed{...}` (balanced braces), or None. An unclosed one is
    ignored: a completion cut off mid-answer has not answered."""
    start = text.rfind("\\boxed{")
    while start != -1:
        depth, i = 0, start + len("\\boxed")
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i + 1:j]
        start = text.rfind("\\boxed{", 0, start)
    return None


def _after_hashes(text: str) -> str | None:
    if "####" not in text:
        return None
    return text.rsplit("####", 1)[1].lstrip().split("\n", 1)[0]


def _after_answer_is(text: str) -> str | None:
    ends = [m.end() for m in _ANSWER_IS.finditer(text)]
    if not ends:
        return None
    return re.split(r"\.\s|\n", text[ends[-1]:], maxsplit=1)[0]  # up to the end of the sentence


def _value_in(span: str) -> str | None:
    """A span's answer: the result of an equation, else its first number."""
    if "=" in span:
        found = _first_number(span.rsplit("=", 1)[1])
        if found is not None:
            return found
    return _first_number(span)


def extract_answer(text: str) -> str | None:
    """The final answer's number as written in `text`, less any "$" ("1,234", "-5", "12.0"), or
    None. Compare it with `same_number`, never as a string."""
    text = text.replace("\u2212", "-")  # the Unicode minus sign
    for span in (last_boxed(text), _after_hashes(text), _after_answer_is(text)):
        found = _value_in(span) if span is not None else None
        if found is not None:
            return found
    numbers = NUMBER.findall(text)
    return numbers[-1].replace("$", "") if numbers else None


def parse_number(text: str | None) -> Fraction | None:
    """The exact value of one written number: "$", thousands commas and trailing punctuation
    dropped; "12.0" and "12" are the same value. None if `text` is not one number ("1,23", "1 2")."""
    if text is None:
        return None
    s = text.replace("\u2212", "-").replace("$", "").strip().rstrip(".!?;:")
    if not _WRITTEN.fullmatch(s):
        return None
    return Fraction(Decimal(s.replace(",", "")))


def same_number(a: str | None, b: str | None) -> bool:
    """Numeric equality of two written numbers; False when either is not a number."""
    x, y = parse_number(a), parse_number(b)
    return x is not None and x == y


def canonical(value: Fraction | int) -> str:
    """How an answer is stored: "12" for twelve, "2.5" for a non-integer."""
    value = Fraction(value)
    return str(value.numerator) if value.denominator == 1 else str(float(value))


def instruction(answer_format: str) -> str:
    """What the prompt asks for, for `answer_format` "hashes" or "boxed"."""
    if answer_format not in _FORMATS:
        raise ValueError(f"unknown answer format {answer_format!r}; expected one of {sorted(_FORMATS)}")
    return _FORMATS[answer_format]


def uses_format(text: str, answer_format: str) -> bool:
    """Did the completion answer in the requested form: "hashes", its last line is "#### N";
    "boxed", it has a `\\boxed{}` holding a number."""
    if answer_format == "boxed":
        box = last_boxed(text)
        return box is not None and _first_number(box) is not None
    if answer_format == "hashes":
        last = text.strip().rsplit("\n", 1)[-1].strip()
        return re.fullmatch(r"####\s*" + NUMBER.pattern + r"[.!]?", last) is not None
    raise ValueError(f"unknown answer format {answer_format!r}; expected one of {sorted(_FORMATS)}")
