"""TextStream's incremental decoding with the real SmolLM2 tokenizer: the text streamed token by
token is exactly the whole output decoded at once (multi-byte characters split over tokens, leading
spaces, newlines), with and without stop strings, and each update decodes only a few tokens (so a
long sample costs linear, not quadratic, decoding)."""

from __future__ import annotations

import random

import pytest

from opentinker_trainer.inference.text import DECODE_CONTEXT_TOKENS, TextStream, find_stop


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


TEXTS = [
    "The answer is 42.\n\nUser: and then?",
    "Café au lait — 東京 🚀🚀 naïve façade, ½ + ¼ = ¾ ✓",
    "def f(x):\n    return x ** 2  # square\n\n\nprint(f(3))",
    "  leading spaces,\ttabs and ünïcödé…",
]


def _stream(tokenizer, ids: list[int], stops=()) -> tuple[str, list[int], bool]:
    calls: list[int] = []

    def decode(part):
        calls.append(len(part))
        return tokenizer.decode(part, skip_special_tokens=True)

    s = TextStream(decode, tuple(stops))
    out = [s.update(ids[: k + 1], final=k == len(ids) - 1) for k in range(len(ids))]
    return "".join(out), calls, s.stopped


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_is_the_whole_output_decoded_at_once(tokenizer, text) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    streamed, calls, stopped = _stream(tokenizer, ids)
    assert streamed == tokenizer.decode(ids, skip_special_tokens=True) and not stopped
    assert max(calls) <= DECODE_CONTEXT_TOKENS + 4  # a few tokens per decode, never the whole output


def test_random_token_ids_stream_as_they_decode_at_once(tokenizer) -> None:
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 60))]
        streamed, _, _ = _stream(tokenizer, ids)
        assert streamed == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("text", TEXTS)
def test_a_stop_string_cuts_the_stream_where_it_starts_in_the_whole_text(tokenizer, text) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    for stop in ("\n\n", "🚀", "x", "ü"):
        streamed, _, stopped = _stream(tokenizer, ids, [stop])
        cut = find_stop(whole, [stop])
        assert streamed == (whole if cut is None else whole[:cut]) and stopped == (cut is not None)


def test_a_long_sample_costs_linear_decoding(tokenizer) -> None:
    ids = tokenizer.encode(" ".join(TEXTS) * 8, add_special_tokens=False)
    streamed, calls, _ = _stream(tokenizer, ids)
    assert streamed == tokenizer.decode(ids, skip_special_tokens=True)
    assert sum(calls) <= 2 * (DECODE_CONTEXT_TOKENS + 2) * len(ids)  # the old stream decoded ~len(ids)**2 / 2
