"""``weights_problem``: whether a full-weight checkpoint's file list holds its config and weights
(the check the client makes on the DownloadCheckpoint manifest before it asks to serve one, and
the inference server on the fetched folder)."""

from __future__ import annotations

import pytest

from opentinker_common.artifacts.full_weights import WEIGHT_FILES, weights_problem


@pytest.mark.parametrize("weights", WEIGHT_FILES)
def test_config_and_any_weights_file_whole_or_sharded_will_do(weights) -> None:
    assert weights_problem("task-1", 4, ["config.json", weights, "tokenizer.json", "trainer_state.pt"]) is None


def test_a_missing_weights_file_or_config_is_named_with_the_task_and_step() -> None:
    got = weights_problem("task-1", 4, ["trainer_state.pt", "config.json", "adapter_model.safetensors"])
    assert got == (
        "task task-1 step 4: its checkpoint lacks config.json or a weights file "
        f"({', '.join(WEIGHT_FILES)}); it holds adapter_model.safetensors, config.json, trainer_state.pt"
    )
    assert weights_problem("task-1", 4, ["model.safetensors"]).startswith("task task-1 step 4: its checkpoint lacks")
    assert weights_problem("task-1", 4, []).endswith("it holds nothing")
    many = weights_problem("task-1", 4, [f"f{i:02}" for i in range(30)])
    assert many.endswith("f08, f09")  # the first ten only
