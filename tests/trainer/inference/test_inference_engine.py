"""Decoding and sampling of the inference service: parity with ``transformers`` generate for the
same seed (through the real gRPC service), logprobs, warpers, streamed text and stop strings."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from opentinker_client.inference import InferenceClient
from opentinker_trainer.inference.sampling import raw_logprobs, warp
from opentinker_trainer.inference.text import TextStream, find_stop, held_back

from tests.support.inference import ServerThread, load_tiny, tiny_runtime

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path):
    server = ServerThread(tiny_runtime(tiny_model_dir))
    client = InferenceClient(server.address)
    yield server, client
    client.close()
    server.close()


def _hf_generate(model, ids: list[int], *, seed, temperature, top_p=1.0, top_k=0, max_new_tokens=12, n=1, eos):
    torch.manual_seed(seed)
    out = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else None,
        top_p=top_p if temperature > 0 else None,
        top_k=top_k if temperature > 0 else None,
        max_new_tokens=max_new_tokens,
        num_return_sequences=n,
        eos_token_id=[eos],
        pad_token_id=eos,
    )
    return [row[len(ids) :].tolist() for row in out]


@pytest.mark.parametrize(
    "settings",
    [
        dict(temperature=0.0),
        dict(temperature=0.8),
        dict(temperature=1.3, top_p=0.9, top_k=50),
        dict(temperature=0.7, n=3),
    ],
    ids=["greedy", "temperature", "top_p_top_k", "n3"],
)
def test_service_samples_what_transformers_generate_samples_for_the_same_seed(served, tiny_model_dir, settings) -> None:
    _, client = served
    tok, model = load_tiny(tiny_model_dir)
    ids = tok(PROMPT)["input_ids"]
    n = settings.get("n", 1)
    ref = _hf_generate(model, ids, seed=11, eos=tok.eos_token_id, **settings)
    out = client.generate(PROMPT, seed=11, max_tokens=12, **settings)
    assert out.prompt_tokens == len(ids)
    for i in range(n):
        got = list(out.samples[i].token_ids)
        assert got == ref[i][: len(got)] and (len(got) == 12 or got[-1] == tok.eos_token_id)
    assert out.completion_tokens == sum(len(s.token_ids) for s in out.samples)
    # Same seed, same answer; another seed (when sampling) a different one.
    again = client.generate(PROMPT, seed=11, max_tokens=12, **settings)
    assert [s.token_ids for s in again.samples] == [s.token_ids for s in out.samples]
    if settings["temperature"] > 0:
        other = client.generate(PROMPT, seed=12, max_tokens=12, **settings)
        assert [s.token_ids for s in other.samples] != [s.token_ids for s in out.samples]


def test_logprobs_are_the_raw_model_distribution(served, tiny_model_dir) -> None:
    _, client = served
    tok, model = load_tiny(tiny_model_dir)
    out = client.generate(PROMPT, temperature=1.7, top_k=5, seed=3, max_tokens=6).samples[0]
    ids = tok(PROMPT)["input_ids"]
    full = torch.tensor([ids + list(out.token_ids)])
    with torch.no_grad():
        logits = model(full).logits[0, len(ids) - 1 : -1]
    expected = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(out.token_ids).unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-4)
    assert len(out.logprobs) == len(out.token_ids)


def test_stream_text_and_tokens_add_up_to_the_unary_answer(served) -> None:
    _, client = served
    full = client.generate(PROMPT, temperature=0.9, seed=5, max_tokens=20, n=2)
    chunks = list(client.generate_stream(PROMPT, temperature=0.9, seed=5, max_tokens=20, n=2))
    assert chunks[-1].usage == (full.prompt_tokens, full.completion_tokens)
    for i in range(2):
        mine = [c for c in chunks if c.index == i and c.usage is None]
        assert "".join(c.text for c in mine) == full.samples[i].text
        assert tuple(t for c in mine for t in c.token_ids) == full.samples[i].token_ids
        assert [c.finish_reason for c in mine if c.finish_reason] == [full.samples[i].finish_reason]


def test_ignore_eos_gives_exactly_max_tokens(served) -> None:
    _, client = served
    out = client.generate(PROMPT, temperature=0, max_tokens=17, ignore_eos=True)
    assert len(out.samples[0].token_ids) == 17 and out.samples[0].finish_reason == "length"


def test_warp_matches_the_transformers_warpers() -> None:
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(3, 50, generator=gen) * 3
        t, k, p = 0.7, 10, 0.8
        ref = TopPLogitsWarper(p)(None, TopKLogitsWarper(k)(None, TemperatureLogitsWarper(t)(None, logits)))
        assert torch.equal(warp(logits, temperature=t, top_k=k, top_p=p), ref)
    tokens = torch.tensor([1, 2, 3])
    assert torch.allclose(raw_logprobs(logits, tokens), torch.log_softmax(logits, -1)[torch.arange(3), tokens])


def test_text_stream_holds_back_possible_stop_strings_and_cuts_at_them() -> None:
    assert find_stop("abc\n\nUser: hi", ["\n\nUser:"]) == 3
    assert held_back("answer 4\n\nUs", ["\n\nUser:"]) == 4
    assert held_back("answer 4", ["\n\nUser:"]) == 0
    assert held_back("caf\ufffd", []) == 1
    pieces = ["The", " answer", " is", " 4", "\n", "\n", "User", ":", " more"]
    s = TextStream(lambda ids: "".join(pieces[i] for i in ids), ("\n\nUser:",))
    out = [s.update(range(k + 1), final=False) for k in range(len(pieces))]
    assert "".join(out) == "The answer is 4" and s.stopped
    assert out[4] == "" and out[5] == ""  # the "\n" pieces waited, then were dropped with the stop string
