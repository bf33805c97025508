"""Limits on uploaded datasets that the scheduler (on upload) and the trainer (on reading) share."""

from __future__ import annotations

__all__ = ["DEFAULT_MAX_DATASET_BYTES"]

#: Largest dataset accepted by default, in bytes (256 MiB).
DEFAULT_MAX_DATASET_BYTES = 256 * 1024 * 1024
