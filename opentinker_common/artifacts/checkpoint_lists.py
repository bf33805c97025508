"""Picking from a task's recorded checkpoints (``ListCheckpoints``, ``LookupTask``: oldest first),
the same for the client that asks to serve one, the inference server that resolves it and the
scheduler that offers it for download.

A training session's ``SaveWeightsForSampler`` writes its checkpoint to a folder named
``sampler_<name>`` (:data:`SAMPLER_PREFIX`; ``SaveState`` writes ``state_<name>``): the folder name
is how a sampler save is told from a full state in the list.
"""

from __future__ import annotations

import os
from typing import Iterable, Sequence, TypeVar

__all__ = ["SAMPLER_PREFIX", "STATE_PREFIX", "at_step", "named_state", "resumable", "sampler_saves", "steps_text"]

#: Folder-name prefix of a training session's ``SaveWeightsForSampler`` checkpoints (``sampler_<name>``).
SAMPLER_PREFIX = "sampler_"
#: Folder-name prefix of a training session's ``SaveState`` checkpoints (``state_<name>``).
STATE_PREFIX = "state_"

C = TypeVar("C")  # a common.v1.Checkpoint (``.path``, ``.step``)


def sampler_saves(checkpoints: Iterable[C]) -> list[C]:
    """The checkpoints of ``checkpoints`` that are sampler saves (their folder is ``sampler_*``), in order."""
    return [c for c in checkpoints if os.path.basename(os.path.normpath(c.path)).startswith(SAMPLER_PREFIX)]


def resumable(checkpoints: Sequence[C]) -> C | None:
    """The newest of ``checkpoints`` (oldest first) a new attempt may resume from: not a sampler
    save, which holds the weights alone (no optimizer, no step, no sequence number); None when
    there is none."""
    saves = {id(c) for c in sampler_saves(checkpoints)}
    return next((c for c in reversed(list(checkpoints)) if id(c) not in saves), None)


def named_state(checkpoints: Sequence[C], name: str) -> C | None:
    """The newest of ``checkpoints`` (oldest first) that is state ``name`` (folder ``state_<name>``), or None."""
    folder = STATE_PREFIX + name
    return next((c for c in reversed(list(checkpoints)) if os.path.basename(os.path.normpath(c.path)) == folder), None)


def at_step(checkpoints: Sequence[C], step: int) -> C | None:
    """The newest of ``checkpoints`` (oldest first) at ``step``, or None."""
    return next((c for c in reversed(list(checkpoints)) if c.step == step), None)


def steps_text(checkpoints: Iterable[C]) -> str:
    """The steps of ``checkpoints`` as a message lists them (``"3, 4, 5"``; ``"none"``)."""
    return ", ".join(str(c.step) for c in checkpoints) or "none"
