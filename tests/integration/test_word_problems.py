"""`scripts/make_word_problems.py`: distinct problems, whole answers >= 0, the same file for the
same seed, and a worked solution whose every equation holds and whose last result is the answer;
the warm start's worked examples are other problems than the RL file's (none of its held-out ones)."""

from __future__ import annotations

import json
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


def test_warm_start_examples_are_other_problems_with_their_worked_solutions(tmp_path) -> None:
    data = wp.write(tmp_path / "wp.jsonl", n=300, seed=0)
    rows = wp.worked_examples(data, n=200, seed=0, system_prompt="Show each step as an equation.")
    rl_prompts = {json.loads(line)["prompt"] for line in data.read_text().splitlines()}
    assert len(rows) == 200
    for row in rows:
        system, user, assistant = row["messages"]
        assert system == {"role": "system", "content": "Show each step as an equation."}
        assert user["role"] == "user" and user["content"] not in rl_prompts
        assert assistant["role"] == "assistant" and assistant["content"].endswith(".")
