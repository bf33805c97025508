#!/usr/bin/env python3
"""Generate grade-school word problems with numeric answers, as a prompt dataset (env_id prompts).

Nothing is downloaded: each problem is a template over names, objects and small quantities,
with two or three steps of addition, subtraction, multiplication or (exact) division, e.g.::

    {"prompt": "Mia has 4 boxes with 3 pencils in each. She gives away 5 pencils. How many
     pencils does Mia have now? Answer with just the number.", "answer": 7, "steps": 2,
     "template": "groups_then_give", "solution": "4 x 3 = 12. 12 - 5 = 7."}

``solution`` is the worked answer, one equation per step ending in the answer: what a warm start
by supervised fine-tuning trains on (``scripts/bench_rlvr.py --warm-start-steps``); the RL
verifier reads only ``answer``.

A fixed seed gives the same file every time (``--seed``); every problem text is distinct, and
answers are whole numbers >= 0. The train/eval split is the task's: ``env_config.eval_fraction``
holds out a seeded share of the lines (:mod:`opentinker_common.prompts`), so no line is in both.

Usage::

    python scripts/make_word_problems.py --out .cache/word_problems.jsonl          # 3000 lines, seed 0
    python scripts/make_word_problems.py --out /tmp/wp.jsonl -n 200 --seed 1
    python scripts/make_word_problems.py --out examples/word_problems.jsonl --worked-out examples/word_solutions.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Callable

NAMES = ("Mia", "Leo", "Ava", "Sam", "Noah", "Emma", "Liam", "Zoe", "Omar", "Lena", "Ravi", "Yuki")
THINGS = ("apples", "pencils", "stickers", "marbles", "cookies", "books", "shells", "cards", "eggs", "coins")
CONTAINERS = ("boxes", "bags", "jars", "baskets", "packs")
SUFFIX = " Answer with just the number."

Template = Callable[[random.Random], tuple[str, int, int, str]]


def _pick(rng: random.Random) -> tuple[str, str, str]:
    return rng.choice(NAMES), rng.choice(THINGS), rng.choice(CONTAINERS)


def buy_then_give(rng: random.Random) -> tuple[str, int, int, str]:
    name, thing, _ = _pick(rng)
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    c = rng.randint(1, a + b - 1)
    text = (
        f"{name} has {a} {thing}. {name} buys {b} more and then gives {c} to a friend. "
        f"How many {thing} does {name} have now?"
    )
    return text, a + b - c, 2, f"{a} + {b} = {a + b}. {a + b} - {c} = {a + b - c}."


def groups_then_give(rng: random.Random) -> tuple[str, int, int, str]:
    name, thing, box = _pick(rng)
    n, k = rng.randint(2, 4), rng.randint(2, 4)
    c = rng.randint(1, n * k - 1)
    text = (
        f"{name} has {n} {box} with {k} {thing} in each. {name} gives away {c} {thing}. "
        f"How many {thing} does {name} have now?"
    )
    return text, n * k - c, 2, f"{n} x {k} = {n * k}. {n * k} - {c} = {n * k - c}."


def share_equally(rng: random.Random) -> tuple[str, int, int, str]:
    name, thing, _ = _pick(rng)
    friends, each = rng.randint(2, 4), rng.randint(2, 5)
    extra = rng.randint(1, friends * each - 1)
    total = friends * each
    text = (
        f"{name} has {total - extra} {thing} and finds {extra} more. {name} shares all of them equally among "
        f"{friends} friends. How many {thing} does each friend get?"
    )
    return text, each, 2, f"{total - extra} + {extra} = {total}. {total} / {friends} = {each}."


def two_people(rng: random.Random) -> tuple[str, int, int, str]:
    a, b = rng.sample(NAMES, 2)
    thing = rng.choice(THINGS)
    x, more = rng.randint(2, 9), rng.randint(1, 5)
    text = f"{a} has {x} {thing}. {b} has {more} more {thing} than {a}. How many {thing} do they have together?"
    return text, x + (x + more), 2, f"{x} + {more} = {x + more}. {x} + {x + more} = {x + x + more}."


def price_change(rng: random.Random) -> tuple[str, int, int, str]:
    name, thing, _ = _pick(rng)
    n, price = rng.randint(2, 4), rng.randint(2, 5)
    paid = n * price + rng.randint(0, 9)
    paid = max(paid, n * price)
    text = (
        f"{name} buys {n} {thing} at {price} dollars each and pays with {paid} dollars. "
        f"How much change does {name} get, in dollars?"
    )
    return text, paid - n * price, 2, f"{n} x {price} = {n * price}. {paid} - {n * price} = {paid - n * price}."


def three_steps(rng: random.Random) -> tuple[str, int, int, str]:
    name, thing, box = _pick(rng)
    n, k = rng.randint(2, 4), rng.randint(2, 4)
    more, c = rng.randint(1, 5), rng.randint(1, 5)
    text = (
        f"{name} has {n} {box} of {k} {thing}. {name} gets {more} more {thing}, then eats or loses {c}. "
        f"How many {thing} are left?"
    )
    return (
        text,
        n * k + more - c,
        3,
        f"{n} x {k} = {n * k}. {n * k} + {more} = {n * k + more}. {n * k + more} - {c} = {n * k + more - c}.",
    )


def double_then_add(rng: random.Random) -> tuple[str, int, int, str]:
    a, b = rng.sample(NAMES, 2)
    thing = rng.choice(THINGS)
    x, y, z = rng.randint(2, 6), rng.randint(1, 5), rng.randint(1, 5)
    text = (
        f"{a} has {x} {thing}. {b} has twice as many as {a}, then {b} gets {y} more and gives {z} back to {a}. "
        f"How many {thing} does {b} have now?"
    )
    return (
        text,
        2 * x + y - z,
        3,
        f"2 x {x} = {2 * x}. {2 * x} + {y} = {2 * x + y}. {2 * x + y} - {z} = {2 * x + y - z}.",
    )


TEMPLATES: dict[str, Template] = {
    f.__name__: f
    for f in (buy_then_give, groups_then_give, share_equally, two_people, price_change, three_steps, double_then_add)
}


def generate(n: int, rng: random.Random, seen: set[str]) -> list[dict]:
    """``n`` distinct problems (texts not in ``seen``, which is updated): dicts with ``prompt``,
    ``answer`` (int >= 0), ``steps`` (2 or 3), ``template`` and ``solution``."""
    out: list[dict] = []
    names = sorted(TEMPLATES)
    while len(out) < n:
        name = rng.choice(names)
        text, answer, steps, solution = TEMPLATES[name](rng)
        if text in seen or answer < 0:
            continue
        seen.add(text)
        out.append({"prompt": text + SUFFIX, "answer": answer, "steps": steps, "template": name, "solution": solution})
    return out


def write(path: Path, *, n: int, seed: int) -> Path:
    """Write ``n`` distinct problems to ``path`` (JSONL); return it."""
    rows = generate(n, random.Random(seed), set())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


#: Added to the seed of the problems a warm start trains on, so they are other problems.
WARM_START_SEED_OFFSET = 1_000_003
#: The system prompt the worked solutions answer: one equation per step.
WORKED_SYSTEM_PROMPT = "Show each step as an equation."


def worked_examples(rl_file: Path, *, n: int, seed: int, system_prompt: str = WORKED_SYSTEM_PROMPT) -> list[dict]:
    """``n`` chat examples for a warm start by ``sft`` (``env_id: chat_jsonl``): *other* problems
    (seed ``seed + WARM_START_SEED_OFFSET``, and no problem text that is in ``rl_file``, so none
    of the RL task's held-out problems is trained on), each ``{"messages": [system, user,
    assistant]}`` with the problem as the user's turn and its worked ``solution`` as the reply
    (no system message when ``system_prompt`` is empty)."""
    seen = {json.loads(line)["prompt"].removesuffix(SUFFIX) for line in rl_file.read_text().splitlines() if line}
    rows = generate(n, random.Random(seed + WARM_START_SEED_OFFSET), seen)
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return [
        {
            "messages": system
            + [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["solution"]}]
        }
        for r in rows
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="the JSONL file to write")
    ap.add_argument("-n", type=int, default=3000, help="problems (default 3000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--worked-out",
        type=Path,
        default=None,
        help="also write a chat dataset of worked solutions to other problems here (an sft warm start)",
    )
    ap.add_argument("--worked-n", type=int, default=1000, help="worked solutions (default 1000)")
    args = ap.parse_args()
    print(write(args.out, n=args.n, seed=args.seed))
    if args.worked_out is not None:
        rows = worked_examples(args.out, n=args.worked_n, seed=args.seed)
        args.worked_out.parent.mkdir(parents=True, exist_ok=True)
        args.worked_out.write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(args.worked_out)


if __name__ == "__main__":
    main()
