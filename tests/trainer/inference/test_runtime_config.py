"""A ModelRuntime takes a small typed config: bounds refused with the field named, and no switch
that only a benchmark sets."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from opentinker_trainer.inference.runtime import ModelRuntime, RuntimeConfig


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("max_concurrent", 0, "max_concurrent: expected an integer >= 1, got 0"),
        ("max_batch_sequences", 0, "max_batch_sequences: expected an integer >= 1, got 0"),
        ("max_batch_tokens", -5, "max_batch_tokens: expected an integer >= 1, got -5"),
        ("max_prefill_tokens", 0, "max_prefill_tokens: expected an integer >= 1, got 0"),
        ("max_resident_adapters", 0, "max_resident_adapters: expected an integer >= 1, got 0"),
        ("prefix_block", 0, "prefix_block: expected an integer >= 1, got 0"),
        ("max_queued", -1, "max_queued: expected an integer >= 0, got -1"),
        ("prefix_cache_tokens", -1, "prefix_cache_tokens: expected an integer >= 0, got -1"),
    ],
)
def test_a_bound_out_of_range_is_refused_naming_the_field(field: str, value: int, expected: str) -> None:
    with pytest.raises(ValueError) as info:
        RuntimeConfig(**{field: value})
    assert str(info.value) == expected


def test_the_config_is_frozen_and_the_constructor_small() -> None:
    cfg = RuntimeConfig(max_queued=0, prefix_cache_tokens=0)  # zero: no queue, no prefix cache
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_concurrent = 2  # type: ignore[misc]
    params = set(inspect.signature(ModelRuntime).parameters)
    assert params == {"model_name", "tokenizer", "model", "stop_token_ids", "resolve", "config", "shared"}
    fields = {f.name for f in dataclasses.fields(RuntimeConfig)}
    assert not fields & {"group_by_adapter", "grouped_lora"}, "one serving path: no switch for a benchmark"
