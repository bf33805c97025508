"""`scripts/make_word_problems.py`: distinct problems, whole answers >= 0, the same file for the
same seed, and a worked solution whose every equation holds and whose last result is the answer."""

from __future__ import annotations

import random
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import make_word_problems as wp  # noqa: E402

EQUATION = re.compile(r"^(\d+) ([+\-x/]) (\d+) = (\d+)$")
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "x": lambda a, b: a * b, "/": lambda a, b: a / b}


def test_every_solution_step_holds_and_ends_in_the_answer() -> None:
    rows = wp.generate(2000, random.Random(0), set())
    assert {r["template"] for r in rows} == set(wp.TEMPLATES)
    for r in rows:
        steps = r["solution"].removesuffix(".").split(". ")
        assert len(steps) == r["steps"], r
        for step in steps:
            a, op, b, result = EQUATION.match(step).groups()
            assert OPS[op](int(a), int(b)) == int(result), r
        assert int(EQUATION.match(steps[-1]).group(4)) == r["answer"], r


def test_problems_are_distinct_whole_and_reproducible(tmp_path) -> None:
    rows = wp.generate(2000, random.Random(3), set())
    assert len({r["prompt"] for r in rows}) == 2000
    assert all(isinstance(r["answer"], int) and r["answer"] >= 0 for r in rows)
    assert (
        wp.write(tmp_path / "a.jsonl", n=50, seed=1).read_text()
        == wp.write(tmp_path / "b.jsonl", n=50, seed=1).read_text()
    )


def test_seen_texts_are_never_generated_again() -> None:
    first = wp.generate(500, random.Random(0), seen := set())
    more = wp.generate(500, random.Random(0), seen)
    assert not {r["prompt"] for r in first} & {r["prompt"] for r in more}
