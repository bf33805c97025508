"""The prompt-lookup proposer: drafts the tokens that followed the latest earlier occurrence of
the sample's tail, the longest tail first, and keeps copying through a loop."""

from __future__ import annotations

from opentinker_trainer.inference.prompt_lookup import propose


def test_the_tokens_after_the_latest_earlier_occurrence_of_the_tail_are_drafted() -> None:
    #        0  1  2  3  4  5  6  7  8  9 10
    tokens = [5, 1, 2, 9, 9, 1, 2, 7, 8, 3, 1, 2]
    # Tail (1, 2) occurs at 1-2 and 5-6: the latest one is followed by 7, 8, 3.
    assert propose(tokens, 3) == [7, 8, 3]
    assert propose(tokens, 1) == [7]


def test_the_longest_tail_that_occurs_wins() -> None:
    # (4, 1, 2) occurs once, earlier than the latest (1, 2): its continuation is drafted.
    tokens = [4, 1, 2, 6, 6, 0, 1, 2, 5, 4, 1, 2]
    assert propose(tokens, 2) == [6, 6]
    assert propose(tokens, 2, max_ngram=2) == [5, 4]


def test_a_loop_keeps_repeating_past_the_end_of_the_text() -> None:
    assert propose([7, 3, 4, 3, 4], 5) == [3, 4, 3, 4, 3]
    assert propose([1, 1, 1], 4) == [1, 1, 1, 1]


def test_nothing_is_drafted_without_an_earlier_occurrence_or_room() -> None:
    assert propose([1, 2, 3, 4, 5], 4) == []
    assert propose([1, 2, 3, 1], 4) == []  # a single token is too short a tail
    assert propose([1, 2, 3, 1], 4, min_ngram=1) == [2, 3, 1, 2]
    assert propose([1, 2, 1, 2], 0) == []
    assert propose([], 3) == [] and propose([1], 3) == []
