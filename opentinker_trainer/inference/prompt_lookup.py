"""Prompt lookup decoding: draft tokens for a greedy sample from its own text (pure functions).

A greedy sample often repeats what its prompt or its own output already holds: names, quoted
text, code, lists, a loop it fell into. Prompt lookup (Saxena 2023, transformers'
``prompt_lookup_num_tokens``) drafts the tokens that followed the latest earlier occurrence of
the sample's last few tokens. The engine checks a draft in one forward pass of its positions and
keeps its longest prefix that greedy decoding chooses too, plus the model's own next token
(:meth:`~.batch.Member.verify`). The output is greedy decoding's, token for token; a step only
yields more tokens when the draft was right.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["MAX_NGRAM", "MIN_NGRAM", "propose"]

#: Longest and shortest tail of the sample that is looked up; the longest tail that occurs wins.
#: A single token matches too often to predict what follows it.
MAX_NGRAM = 3
MIN_NGRAM = 2


def propose(
    tokens: Sequence[int], max_draft: int, *, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM
) -> list[int]:
    """Up to ``max_draft`` tokens likely to follow ``tokens`` (the prompt, then the sample so far).

    For ``n`` from ``max_ngram`` down to ``min_ngram``: find the latest earlier occurrence of the
    last ``n`` tokens and draft the tokens that followed it. The copy may run into the tail
    itself and on into the draft, so a loop of period ``p`` keeps repeating (``a b a b`` drafts
    ``a b a ...``). Returns ``[]`` when no tail of ``min_ngram`` or more tokens occurs earlier,
    or when ``max_draft < 1``.
    """
    size = len(tokens)
    if max_draft < 1:
        return []
    for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
        tail = list(tokens[size - n :])
        last = tail[-1]
        for end in range(size - 2, n - 2, -1):  # ``end``: last index of a candidate occurrence
            if tokens[end] == last and list(tokens[end - n + 1 : end + 1]) == tail:
                draft: list[int] = []
                for j in range(end + 1, end + 1 + max_draft):
                    draft.append(tokens[j] if j < size else draft[j - size])
                return draft
    return []
