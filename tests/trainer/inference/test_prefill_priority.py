"""The scheduling rule for time to first token under load, counted in engine steps: a request
that arrives while other requests decode gets its first token after at most the one decode step
in flight (its prefill runs before the batch's next decode step), with or without an adapter;
by default it does not even wait for the step in flight: it is prefilled between two of the
step's layers, and gets the tokens it gets alone."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from opentinker_trainer.inference.engine import SamplingParams

from tests.support.inference import make_adapter, tiny_runtime
from tests.support.waiting import wait_for

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def adapter(tiny_model_dir: Path, tmp_path_factory) -> dict[str, Path]:
    return {"task-p0": make_adapter(tiny_model_dir, tmp_path_factory.mktemp("prefill") / "p0", seed=3)}


def _prepared(runtime, adapter, max_tokens):
    return runtime.prepare(
        model="",
        adapter=adapter or "",
        text=PROMPT,
        messages=None,
        params=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )


@pytest.mark.parametrize("newcomer", [None, "task-p0"], ids=["base", "adapter"])
def test_a_request_arriving_mid_decode_gets_its_first_token_after_at_most_one_decode_step(
    tiny_model_dir, adapter, newcomer
) -> None:
    runtime = tiny_runtime(tiny_model_dir, adapter, admit_mid_step=False)

    async def scenario() -> tuple[list[int], int]:
        # Load the adapter first, so the newcomer measures scheduling, not a load.
        async for _ in runtime.run(_prepared(runtime, "task-p0", 1)):
            pass
        long = [runtime.run(_prepared(runtime, name, 200)) for name in (None, "task-p0", None)]
        for stream in long:
            await anext(stream)  # all three decode in one batch now
        for _ in range(5):
            await anext(long[0])
        runtime.first_token_waits.clear()
        late = runtime.run(_prepared(runtime, newcomer, 3))
        await anext(late)
        waits = list(runtime.first_token_waits)
        others = runtime.batch_rows
        async for _ in late:
            pass
        for stream in long:
            await stream.aclose()
        return waits, others

    try:
        waits, others = asyncio.run(scenario())
    finally:
        runtime.close()
    assert others == 4  # it joined a batch that was decoding three other rows
    assert waits == [0] or waits == [1], waits  # not behind a decode step that started after it arrived


@pytest.mark.parametrize("newcomer", [None, "task-p0"], ids=["base", "adapter"])
def test_a_request_arriving_mid_step_is_prefilled_between_two_layers_of_it(tiny_model_dir, adapter, newcomer) -> None:
    runtime = tiny_runtime(tiny_model_dir, adapter)
    hold, holding = threading.Event(), threading.Event()

    def first_layer(module, args):  # holds one decode step in its first layer until the request is queued
        if hold.is_set() and not runtime._in_early:
            hold.clear()
            holding.set()
            wait_for(lambda: runtime.queued == 1, timeout=30, what="the newcomer queued", interval=0.01)

    async def scenario():
        alone = [t async for e in runtime.run(_prepared(runtime, newcomer, 4)) for t in e.token_ids]
        long = [runtime.run(_prepared(runtime, name, 200)) for name in (None, "task-p0", None)]
        for stream in long:
            await anext(stream)  # all three decode in one batch now
        runtime.first_token_waits.clear()
        before = runtime.admitted_mid_step
        hold.set()
        assert await asyncio.to_thread(holding.wait, 30)  # a decode step is held in its first layer
        late = runtime.run(_prepared(runtime, newcomer, 4))
        got = [t async for e in late for t in e.token_ids]
        for stream in long:
            await stream.aclose()
        return alone, got, list(runtime.first_token_waits), runtime.admitted_mid_step - before

    handle = runtime._layers[0].register_forward_pre_hook(first_layer)
    try:
        alone, got, waits, mid_step = asyncio.run(scenario())
    finally:
        handle.remove()
        runtime.close()
    assert mid_step == 1  # prefilled inside the held step, not after it
    assert waits == [0]
    assert got == alone and len(got) == 4  # the tokens it gets alone
