"""Prefix caching: prompts that start with the same blocks of tokens as earlier ones on the same
adapter prefill only the rest, and get the same outputs as with caching off (solo and batched,
greedy and seeded sampling, several adapters); an adapter that leaves the model takes its blocks
with it; the bound evicts least recently used blocks with the blocks after them."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from opentinker_client.inference import InferenceClient
from opentinker_trainer.inference.prefix_cache import PrefixCache

from tests.support.inference import ServerThread, make_adapter, tiny_runtime

PREAMBLE = (
    "You are a careful assistant. Answer in one short sentence, name your sources, and never make up "
    "numbers you do not know. "
)
QUESTIONS = ["What is the capital of France?", "Why is the sky blue?", "Hello", "Name a prime number above ten."]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("prefix-adapters")
    return {f"task-p{i}": make_adapter(tiny_model_dir, root / f"p{i}", seed=40 + i) for i in range(2)}


def _cases(adapters) -> list[dict]:
    names = [None, *adapters]
    cases = []
    for i in range(12):
        case = dict(text=PREAMBLE + QUESTIONS[i % 4], adapter=names[i % 3], max_tokens=3 + i % 5, ignore_eos=True)
        case.update(temperature=0.8, seed=7 + i) if i % 4 == 1 else case.update(temperature=0.0)
        if i % 5 == 2:
            case.update(n=2)
        if i == 11:
            case["text"] = QUESTIONS[0]  # no shared prefix: a row without a reused part
        cases.append(case)
    return cases


def _stream(client: InferenceClient, case: dict):
    case = dict(case)
    text = case.pop("text")
    tokens = [[] for _ in range(case.get("n", 1))]
    for chunk in client.generate_stream(text, **case):
        tokens[chunk.index].extend(chunk.token_ids)
    return [tuple(t) for t in tokens]


def _outputs(client, cases, *, together: bool):
    if not together:
        return [_stream(client, c) for c in cases]
    start = threading.Barrier(len(cases))

    def one(case):
        start.wait()
        return _stream(client, case)

    with ThreadPoolExecutor(len(cases)) as pool:
        return list(pool.map(one, cases))


def test_reused_prefixes_give_the_outputs_of_full_prefills(tiny_model_dir, adapters) -> None:
    cases = _cases(adapters)
    plain = ServerThread(tiny_runtime(tiny_model_dir, adapters, prefix_cache_tokens=0))
    try:
        reference = _outputs(InferenceClient(plain.address), cases, together=False)
    finally:
        plain.close()
    assert len({r[0] for r in reference[:3]}) == 3  # each adapter changes the answer

    server = ServerThread(tiny_runtime(tiny_model_dir, adapters, prefix_cache_tokens=4096, prefix_block=8))
    try:
        client, runtime = InferenceClient(server.address), server.runtime
        assert _outputs(client, cases, together=False) == reference
        # Every request after the first on each adapter found the preamble's blocks.
        blocks = (len(runtime.tokenizer(PREAMBLE)["input_ids"]) - 1) // 8
        assert blocks >= 2
        assert runtime.prefix.hit_tokens >= 8 * blocks * (len(cases) - 1 - 3)
        hits = runtime.prefix.hit_tokens
        assert _outputs(client, cases, together=True) == reference
        assert runtime.prefix.hit_tokens - hits >= 8 * blocks * (len(cases) - 1)
        assert runtime.max_batch_rows_seen >= 6
    finally:
        server.close()


def test_an_adapter_that_leaves_the_model_takes_its_blocks(tiny_model_dir, adapters) -> None:
    a, b = list(adapters)
    server = ServerThread(tiny_runtime(tiny_model_dir, adapters, max_resident_adapters=1, prefix_block=8))
    try:
        client, runtime = InferenceClient(server.address), server.runtime
        case = dict(text=PREAMBLE + QUESTIONS[1], max_tokens=2, temperature=0.0)
        first = _stream(client, dict(case, adapter=a))
        held = runtime.prefix.tokens
        assert held > 0
        _stream(client, dict(case, adapter=b))  # evicts a: only b's blocks stay
        assert runtime.prefix.tokens == held
        hits = runtime.prefix.hit_tokens
        assert _stream(client, dict(case, adapter=a)) == first  # a again, loaded fresh
        assert runtime.prefix.hit_tokens == hits  # nothing of the earlier a was reused
    finally:
        server.close()


class _Layer:
    def __init__(self, width: int) -> None:
        self.keys = torch.arange(width, dtype=torch.float32).reshape(1, 1, width, 1)
        self.values = -self.keys


def test_the_bound_evicts_the_oldest_block_with_the_blocks_after_it() -> None:
    cache = PrefixCache(block=2, max_tokens=6)
    layers = [_Layer(8)]
    first = [1, 2, 3, 4, 5]
    cache.store(None, first, layers, 0, list(range(5)))
    assert cache.tokens == 4  # two complete blocks
    length, kv = cache.match(None, first)
    assert length == 4 and kv[0][0].flatten().tolist() == [0, 1, 2, 3]
    assert cache.match(None, [1, 2, 3, 4])[0] == 2  # one token must be left to run
    assert cache.match("other", first)[0] == 0  # another adapter's prefix is its own
    # Least recently used first: (3, 4), then (1, 2) (touched by the shorter match).
    cache.store(None, [9, 9, 7, 7], layers, 0, [4, 5, 6, 7])  # two more blocks; room for three
    assert cache.tokens == 6
    assert cache.match(None, first)[0] == 2  # (3, 4) went
    assert cache.match(None, [9, 9, 7, 7, 0])[0] == 4
    assert cache.match(None, [5, 5, 0])[0] == 0
    cache.store(None, [5, 5], layers, 0, [0, 1])  # (1, 2) is the oldest now
    assert cache.match(None, first)[0] == 0
    assert cache.match(None, [9, 9, 7, 7, 0])[0] == 4 and cache.match(None, [5, 5, 0])[0] == 2
    # Now (9, 9) is the oldest and (7, 7) after it: both go for one new block.
    cache.store(None, [3, 3], layers, 0, [0, 1])
    assert cache.tokens == 4
    assert cache.match(None, [9, 9, 7, 7, 0])[0] == 0 and cache.match(None, [3, 3, 0])[0] == 2
    cache.forget(None)
    assert cache.tokens == 0
