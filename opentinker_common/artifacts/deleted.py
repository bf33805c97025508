"""Words for a task whose artifacts were deleted (``DeleteTaskArtifacts``, ``opentinker rm``), the
same in every refusal that meets it: a download, an ``init_from``, serving its adapter or policy."""

from __future__ import annotations

import datetime as _dt

from opentinker.common.v1 import common_pb2

__all__ = ["deleted_words"]


def deleted_words(event: common_pb2.TaskEvent) -> str:
    """``its artifacts were deleted at 2026-12-01 23:04:05 UTC by alice (DeleteTaskArtifacts,
    `opentinker rm`)`` for the task's ``artifacts_deleted`` event (no ``by`` when the event names
    nobody, no time when it has none)."""
    when = ""
    if event.HasField("time"):
        t = _dt.datetime.fromtimestamp(event.time.ToNanoseconds() / 1e9, _dt.timezone.utc)
        when = f" at {t:%Y-%m-%d %H:%M:%S} UTC"
    by = event.artifacts_deleted.deleted_by
    return f"its artifacts were deleted{when}{f' by {by}' if by else ''} (DeleteTaskArtifacts, `opentinker rm`)"
