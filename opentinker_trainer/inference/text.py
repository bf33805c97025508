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


#: Tokens before the newest ones that are decoded again with them (:class:`TextStream`): the
#: context a tokenizer needs to decode a token as it reads in the whole text (a leading space,
#: bytes of one character split over tokens). vLLM's incremental detokenizer uses 5 too.
DECODE_CONTEXT_TOKENS = 5


@dataclass
class TextStream:
    """Decoded text of one sample and how much of it was already sent.

    Decoding is incremental, as vLLM's ``detokenize_incrementally``: each update decodes only
    the tokens since the last text that was fixed plus :data:`DECODE_CONTEXT_TOKENS` before them,
    and keeps the part past those context tokens' own text; so a sample of ``n`` tokens costs
    O(n) token decodes in all instead of O(n^2). A tail that decodes to an incomplete character
    (``\\ufffd``) is decoded again with the next token.

    Args:
        decode: ``token ids -> text`` (the tokenizer's decode without special tokens).
        stops: stop strings.
    """

    decode: object
    stops: tuple[str, ...] = ()
    text: str = ""
    sent: int = 0
    stopped: bool = False
    #: Tokens whose text is in :attr:`text` for good (``_read``), and where the context of the
    #: next decode starts (``_prefix``).
    _prefix: int = 0
    _read: int = 0

    def update(self, token_ids: Sequence[int], *, final: bool) -> str:
        """Decode the new tokens; return the new text that is safe to send (everything left when
        ``final``). Sets :attr:`stopped` when a stop string appeared: the text is cut before it
        and nothing after it is ever sent. ``token_ids`` is the sample's whole output so far (it
        only grows between calls)."""
        if self.stopped:
            return ""
        ids = list(token_ids)
        before = len(self.text)
        if len(ids) > self._read:
            context = self.decode(ids[self._prefix : self._read]) if self._read > self._prefix else ""  # type: ignore[operator]
            window = self.decode(ids[self._prefix :])  # type: ignore[operator]
            if window.startswith(context) and (final or not window.endswith("\ufffd")):
                self.text += window[len(context) :]
                self._prefix, self._read = max(0, len(ids) - DECODE_CONTEXT_TOKENS), len(ids)
            elif not window.startswith(context):  # the context decodes otherwise with what follows
                self.text = self.decode(ids)  # type: ignore[operator]
                self._prefix, self._read = max(0, len(ids) - DECODE_CONTEXT_TOKENS), len(ids)
                before = 0
        longest = max((len(s) for s in self.stops), default=0)
        start = max(0, before - longest + 1)  # a stop string that ends in the new text starts here or later
        hits = [i for stop in self.stops if stop and (i := self.text.find(stop, start)) >= 0]
        if hits:
            self.text, self.stopped, final = self.text[: min(hits)], True, True
        text = self.text
        end = len(text) if final else len(text) - held_back(text, self.stops)
        if end <= self.sent:
            return ""
        delta = text[self.sent : end]
        self.sent = end
        return delta
