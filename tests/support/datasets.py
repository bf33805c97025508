"""Small chat datasets written for SFT runs in tests."""

from __future__ import annotations

import json
import random
from pathlib import Path


def arithmetic_chat_jsonl(path: Path, n: int = 24, seed: int = 0) -> Path:
    """Write ``n`` one-digit additions as chat JSONL to ``path`` and return ``path``.

    Each line is ``{"messages": [{"role": "user", "content": "What is A + B?"}, {"role":
    "assistant", "content": "A+B"}]}``; A and B are drawn from ``random.Random(seed)`` (A, then B,
    per line), so the same arguments write the same bytes.
    """
    rng = random.Random(seed)
    with open(path, "w") as fh:
        for _ in range(n):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            fh.write(
                json.dumps(
                    {
                        "messages": [
                            {"role": "user", "content": f"What is {a} + {b}?"},
                            {"role": "assistant", "content": str(a + b)},
                        ]
                    }
                )
                + "\n"
            )
    return path
