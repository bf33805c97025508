"""Decode steps run back to back on the model thread: a busy event loop does not stop the batch,
and every request still gets all its tokens, in order, and one end. The engine loop still gets its
turn between two steps when it has work (an adapter to load, a queued or cancelled request): see
test_continuous_batching.py, a long generation does not starve a short one."""

from __future__ import annotations

import asyncio

from opentinker_trainer.inference.engine import SamplingParams

from tests.support.inference import tiny_runtime
from tests.support.waiting import wait_for


def _prepared(runtime, max_tokens: int):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return runtime.prepare(model="", adapter="", text="Once upon a time", messages=None, params=params)


def test_the_batch_keeps_decoding_while_the_event_loop_is_busy(tiny_model_dir) -> None:
    runtime = tiny_runtime(tiny_model_dir)

    async def scenario():
        alone = [e async for e in runtime.run(_prepared(runtime, 24))]
        stream = runtime.run(_prepared(runtime, 24))
        events = [await anext(stream)]
        start = runtime.decode_tokens
        # This coroutine holds the event loop's thread while the model thread decodes on (a step
        # may yield several tokens: greedy drafts).
        wait_for(lambda: runtime.decode_tokens >= start + 12, timeout=30, what="decoded tokens", interval=0.01)
        events += [e async for e in stream]
        return alone, events

    try:
        alone, events = asyncio.run(scenario())
    finally:
        runtime.close()
    tokens = [t for e in alone for t in e.token_ids]
    assert len(tokens) == 24
    assert [t for e in events for t in e.token_ids] == tokens  # all of them, in order
    assert [e.usage for e in events if e.usage] == [(alone[-1].usage[0], 24)]  # one end, after the last token
    assert runtime.running == 0 and runtime.batch_rows == 0
