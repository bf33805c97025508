"""Continuous batching through the real gRPC service on the tiny model: concurrent requests of
several adapters and the base decode in one batch and each gets exactly its solo output; the
queue bound, first-in-first-out admission, cancellation freeing a row, no starvation."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from opentinker_client import ResourceExhaustedError
from opentinker_client.inference import InferenceClient

from tests.support.inference import ServerThread, make_adapter, tiny_runtime
from tests.support.waiting import wait_for

PROMPTS = ["Once upon a time", "The capital of France is", "Hello", "What is 2 + 3? Answer with a number and why"]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("batch-adapters")
    return {f"task-b{i}": make_adapter(tiny_model_dir, root / f"b{i}", seed=10 + i) for i in range(3)}


def _cases(adapters) -> list[dict]:
    """16 requests over 3 adapters and the base: different prompts (so different padding),
    lengths, n, greedy and seeded sampling, a stop string."""
    names = [None, *adapters]
    cases = []
    for i in range(16):
        case = dict(
            text=PROMPTS[i % 4],
            adapter=names[i % 4],
            max_tokens=4 + (i * 5) % 17,
            temperature=0.0,
            ignore_eos=True,
        )
        if i % 5 == 1:
            case.update(n=2)
        if i % 6 == 2:
            case.update(temperature=0.9, seed=100 + i)
        if i % 7 == 3:
            case.update(stop=[" the"], ignore_eos=False)
        cases.append(case)
    return cases


def _stream(client: InferenceClient, case: dict):
    case = dict(case)
    text = case.pop("text")
    n = case.get("n", 1)
    tokens, texts, finish = [[] for _ in range(n)], [""] * n, [None] * n
    for chunk in client.generate_stream(text, **case):
        if chunk.usage is not None:
            continue
        tokens[chunk.index].extend(chunk.token_ids)
        texts[chunk.index] += chunk.text
        finish[chunk.index] = chunk.finish_reason or finish[chunk.index]
    return [(tuple(t), s, f) for t, s, f in zip(tokens, texts, finish)]


def test_interleaved_requests_over_three_adapters_get_their_solo_outputs(tiny_model_dir, adapters) -> None:
    server = ServerThread(tiny_runtime(tiny_model_dir, adapters))
    try:
        client = InferenceClient(server.address)
        cases = _cases(adapters)
        solo = [_stream(client, c) for c in cases]
        assert len({s[0][0] for s in solo[:4]}) == 4  # each adapter really changes the answer
        solo_steps = server.runtime.steps
        start = threading.Barrier(len(cases))

        def together(case):
            start.wait()
            return _stream(client, case)

        with ThreadPoolExecutor(len(cases)) as pool:
            got = list(pool.map(together, cases))
        for i, (mine, alone) in enumerate(zip(got, solo)):
            assert mine == alone, f"request {i} ({cases[i]}) differs from its solo output"
        # They really decoded together: far fewer steps than one after another, rows shared a pass.
        assert server.runtime.steps - solo_steps < solo_steps / 2
        assert server.runtime.max_batch_rows_seen >= 8
        assert server.runtime.running == 0 and server.runtime.batch_rows == 0
    finally:
        server.close()


@pytest.fixture
def small_server(tiny_model_dir, adapters):
    server = ServerThread(tiny_runtime(tiny_model_dir, adapters, max_concurrent=1, max_queued=1))
    yield server
    server.close()


def test_a_full_queue_is_refused_with_the_numbers_and_a_cancelled_stream_frees_its_row_at_once(small_server) -> None:
    runtime = small_server.runtime
    client = InferenceClient(small_server.address)
    long = client.generate_stream(PROMPTS[0], adapter="task-b0", temperature=0, max_tokens=400, ignore_eos=True)
    next(long)
    waiting: list = []
    queued = threading.Thread(
        target=lambda: waiting.append(client.generate(PROMPTS[1], temperature=0, max_tokens=3, ignore_eos=True))
    )
    queued.start()
    wait_for(lambda: runtime.queued == 1, timeout=30, what="the second request waits in the queue")
    with pytest.raises(
        ResourceExhaustedError,
        match=r"queue is full: 1 requests waiting \(max_queued_requests 1\) behind 1 decoding "
        r"\(max_concurrent_requests 1; 1 of 64 sequences, \d+ of 65536 batch tokens\)",
    ):
        client.generate(PROMPTS[2], max_tokens=2)
    assert not waiting  # first in, first out: the queued one waits for the running one
    long.close()  # the client goes away: its row leaves the batch, the queued request takes its place
    queued.join(60)
    assert len(waiting[0].samples[0].token_ids) == 3
    wait_for(lambda: runtime.running == 0, timeout=30, what="the cancelled stream's row and pin are released")
    assert runtime.batch_rows == 0 and runtime.registry.list()[0].in_use == 0
    assert runtime.steps < 200  # nothing kept generating the departed stream's 400 tokens


def test_a_long_generation_does_not_starve_a_short_one(tiny_model_dir, adapters) -> None:
    server = ServerThread(tiny_runtime(tiny_model_dir, adapters))
    try:
        client = InferenceClient(server.address)
        long = client.generate_stream(PROMPTS[0], temperature=0, max_tokens=300, ignore_eos=True)
        next(long)
        short = client.generate(PROMPTS[1], adapter="task-b1", temperature=0, max_tokens=5, ignore_eos=True)
        assert len(short.samples[0].token_ids) == 5
        # The long one is still decoding: the short one finished alongside it, not after it.
        assert server.runtime.batch_rows == 1 and server.runtime.running == 1
        assert sum(len(c.token_ids) for c in long) == 299
    finally:
        server.close()
