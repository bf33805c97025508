"""The scheduling rule for time to first token under load, counted in engine steps: a request
that arrives while other requests decode gets its first token after at most the one decode step
in flight (its prefill runs before the batch's next decode step), with or without an adapter."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from opentinker_trainer.inference.engine import SamplingParams

from tests.support.inference import make_adapter, tiny_runtime

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
    runtime = tiny_runtime(tiny_model_dir, adapter)

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
