"""Small datasets written by tests."""

from __future__ import annotations

import json
import random
from pathlib import Path


def write_arithmetic_chat_jsonl(path: Path, n: int = 12, seed: int = 0) -> Path:
    """``n`` chat examples "What is a + b?" -> the sum (one-digit a and b), one JSON line each."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        messages = [{"role": "user", "content": f"What is {a} + {b}?"}, {"role": "assistant", "content": str(a + b)}]
        rows.append(json.dumps({"messages": messages}))
    path.write_text("\n".join(rows) + "\n")
    return path
