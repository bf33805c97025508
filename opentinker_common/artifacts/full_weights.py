"""What a full-weight checkpoint holds, the same for the client that asks to serve one and the
inference server that loads it (:mod:`opentinker_trainer.inference.resolve`).

A full-weight checkpoint (format :data:`FULL_FORMAT`, written by ``sft`` with ``lora: false`` and
by ``full_rl`` GRPO on a text environment) is a transformers ``save_pretrained`` folder:
``config.json``, the weights (:data:`WEIGHT_FILES`, whole or sharded), the tokenizer and
``trainer_state.pt``.
"""

from __future__ import annotations

from typing import Iterable

__all__ = ["FULL_FORMAT", "WEIGHT_FILES", "weights_problem"]

#: Checkpoint format of full weights: a transformers ``save_pretrained`` folder.
FULL_FORMAT = "hf_full"
#: Files of which a full-weight checkpoint holds at least one: its weights, whole or sharded.
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def weights_problem(task_id: str, step: int, files: Iterable[str]) -> str | None:
    """``None`` when ``files`` (the checkpoint's file names, relative to its folder) hold
    ``config.json`` and a weights file; else the words saying what is missing, naming the task,
    the step and (the first ten of) the files there are."""
    names = set(files)
    if "config.json" in names and names & set(WEIGHT_FILES):
        return None
    held = ", ".join(sorted(names)[:10]) or "nothing"
    return (
        f"task {task_id} step {step}: its checkpoint lacks config.json or a weights file "
        f"({', '.join(WEIGHT_FILES)}); it holds {held}"
    )
