"""Text of a sample as its tokens arrive: incremental decoding and stop strings (pure functions).

Streaming sends only text that can no longer change: a tail that decodes to an incomplete UTF-8
character (``\\ufffd``) waits for the next token, and so does a tail that could still grow into a
stop string (``"\\n\\nUs"`` while ``"\\n\\nUser:"`` is a stop string). Special tokens (EOS, end of
turn) are not part of the text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["find_stop", "held_back", "TextStream"]


def find_stop(text: str, stops: Sequence[str]) -> int | None:
    """Index where the earliest stop string starts in ``text``, or None."""
    hits = [i for s in stops if s and (i := text.find(s)) >= 0]
    return min(hits) if hits else None


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many characters at the end of ``text`` must wait: the longest tail that is a proper
    prefix of a stop string, or a trailing replacement character (half a UTF-8 character)."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    if text.endswith("\ufffd"):
        hold = max(hold, 1)
    return hold


@dataclass
class TextStream:
    """Decoded text of one sample and how much of it was already sent.

    Args:
        decode: ``token ids -> text`` (the tokenizer's decode without special tokens).
        stops: stop strings.
    """

    decode: object
    stops: tuple[str, ...] = ()
    text: str = ""
    sent: int = 0
    stopped: bool = False

    def update(self, token_ids: Sequence[int], *, final: bool) -> str:
        """Re-decode after new tokens; return the new text that is safe to send (everything
        left when ``final``). Sets :attr:`stopped` when a stop string appeared: the text is cut
        before it and nothing after it is ever sent."""
        if self.stopped:
            return ""
        text = self.decode(list(token_ids))  # type: ignore[operator]
        cut = find_stop(text, self.stops)
        if cut is not None:
            text, self.stopped, final = text[:cut], True, True
        self.text = text
        end = len(text) if final else len(text) - held_back(text, self.stops)
        if end <= self.sent:
            return ""
        delta = text[self.sent : end]
        self.sent = end
        return delta
