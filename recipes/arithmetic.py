"""Arithmetic word problems, generated offline from a seeded `random.Random`: no data set, the
same seed gives the same problems, and every answer is an integer the generator computes.

Levels (`LEVELS`), each a list of templates drawn uniformly:
1. one addition or subtraction of numbers below 20 ("Tom has 3 apples. He buys 4 more. ...");
2. two additions / subtractions, numbers up to 50;
3. a multiplication or an exact division, then an addition or subtraction, numbers up to ~150;
4. three steps with multiplications and an exact division, numbers in the hundreds.

Each `Problem` also carries `expr`, the same computation as a Python expression over the numbers
in the text (`/` always divides exactly), so a test can check the answer without trusting it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

NAMES = [("Tom", "he"), ("Sara", "she"), ("Ben", "he"), ("Lily", "she"), ("Sam", "he"), ("Emma", "she"),
         ("Jack", "he"), ("Mia", "she"), ("Leo", "he"), ("Anna", "she"), ("Max", "he"), ("Zoe", "she")]
THINGS = ["apples", "pencils", "marbles", "stickers", "cookies", "books", "cards", "balloons", "shells", "stamps"]


@dataclass(frozen=True)
class Problem:
    question: str
    expr: str  # the computation, e.g. "(3 * 12) - 5"
    answer: int
    level: int


def _people(rng: random.Random) -> tuple[str, str, str]:
    """A name, its pronoun (capitalised), and a friend with another name."""
    (name, he), (friend, _) = rng.sample(NAMES, 2)
    return name, he.capitalize(), friend


def _level1(rng: random.Random) -> tuple[str, str, int]:
    name, he, friend = _people(rng)
    things = rng.choice(THINGS)
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        return (f"{name} has {a} {things}. {he} buys {b} more. How many {things} does {name} have now?",
                f"{a} + {b}", a + b)
    if kind == 1:
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        return (f"{name} has {a} {things} and {friend} has {b} {things}. How many {things} do they have "
                f"together?", f"{a} + {b}", a + b)
    a = rng.randint(6, 19)
    b = rng.randint(2, a - 1)
    return (f"{name} has {a} {things}. {he} gives {b} {things} to {friend}. How many {things} does {name} "
            f"have left?", f"{a} - {b}", a - b)


def _level2(rng: random.Random) -> tuple[str, str, int]:
    name, he, friend = _people(rng)
    things = rng.choice(THINGS)
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randint(5, 30), rng.randint(2, 20)
        c = rng.randint(1, a + b - 1)
        return (f"{name} has {a} {things}. {he} buys {b} more and then gives {c} to {friend}. How many "
                f"{things} does {name} have now?", f"{a} + {b} - {c}", a + b - c)
    if kind == 1:
        a = rng.randint(10, 50)
        b, c = rng.randint(1, a - 1), rng.randint(2, 20)
        return (f"{name} had {a} {things}. {he} lost {b} of them and then found {c} more. How many {things} "
                f"does {name} have now?", f"{a} - {b} + {c}", a - b + c)
    a, b, c = rng.randint(2, 30), rng.randint(2, 20), rng.randint(2, 20)
    return (f"There are {a} {things} in a box. {name} puts in {b} more and {friend} puts in {c} more. How many "
            f"{things} are in the box now?", f"{a} + {b} + {c}", a + b + c)


def _level3(rng: random.Random) -> tuple[str, str, int]:
    name, he, friend = _people(rng)
    things = rng.choice(THINGS)
    kind = rng.randrange(3)
    if kind == 0:
        boxes, each = rng.randint(2, 9), rng.randint(3, 12)
        c = rng.randint(2, boxes * each - 1)
        return (f"{name} buys {boxes} boxes of {things}. Each box holds {each} {things}. {he} gives {c} "
                f"{things} to {friend}. How many {things} does {name} have left?",
                f"{boxes} * {each} - {c}", boxes * each - c)
    if kind == 1:
        friends, share = rng.randint(2, 9), rng.randint(2, 15)
        total, extra = friends * share, rng.randint(1, 10)
        return (f"{name} has {total} {things} and shares them equally among {friends} friends. Then each "
                f"friend gets {extra} more {things}. How many {things} does each friend have?",
                f"{total} / {friends} + {extra}", total // friends + extra)
    rows, per_row, extra = rng.randint(3, 12), rng.randint(4, 12), rng.randint(2, 30)
    return (f"A shelf has {rows} rows of {things} with {per_row} {things} in each row. {name} adds {extra} "
            f"more {things}. How many {things} are on the shelf now?",
            f"{rows} * {per_row} + {extra}", rows * per_row + extra)


def _level4(rng: random.Random) -> tuple[str, str, int]:
    name, he, _ = _people(rng)
    kind = rng.randrange(2)
    if kind == 0:
        wage, hours, days = rng.randint(8, 25), rng.randint(2, 8), rng.randint(3, 7)
        spent = rng.randint(10, wage * hours * days - 1)
        return (f"{name} earns {wage} dollars per hour. {he} works {hours} hours a day for {days} days and "
                f"then spends {spent} dollars. How many dollars does {name} have left?",
                f"{wage} * {hours} * {days} - {spent}", wage * hours * days - spent)
    trays, per_tray, bag = rng.randint(3, 9), rng.randint(12, 30), rng.randint(3, 8)
    bags = rng.randint(1, (trays * per_tray - 1) // bag)
    eaten = trays * per_tray - bags * bag  # chosen so the rest fills whole bags
    return (f"{name} bakes {trays} trays of cookies with {per_tray} cookies on each tray. {he} eats {eaten} "
            f"cookies and packs the rest into bags of {bag}. How many bags does {name} fill?",
            f"({trays} * {per_tray} - {eaten}) / {bag}", (trays * per_tray - eaten) // bag)


LEVELS = {1: _level1, 2: _level2, 3: _level3, 4: _level4}


def make_problem(rng: random.Random, level: int) -> Problem:
    if level not in LEVELS:
        raise ValueError(f"unknown arithmetic level {level}; expected one of {sorted(LEVELS)}")
    question, expr, answer = LEVELS[level](rng)
    return Problem(question, expr, answer, level)
