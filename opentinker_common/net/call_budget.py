"""How long a call waited inside the server before the application took it up.

gRPC sends a call's deadline as the time left (``grpc-timeout``), and the server's clock starts
when the headers arrive, before the call waits in gRPC core's queue for the application (grpc.aio
takes one call per event-loop turn, so under load the wait is seconds). A client that also sends
the budget it gave the call (:func:`budget_metadata`, ``opentinker-timeout-ms``) lets the server
read that wait as ``budget - time remaining`` (:func:`waited_s`): no clocks are compared, so it
holds across machines. The scheduler refuses a submit that waited too long with the retry advice
of an overloaded server (``opentinker_scheduler.admission.load``).

One attempt per call: a client that retries sends each attempt's own budget (gRPC's own retries
re-send the first attempt's metadata, so calls that carry it are not retried by gRPC).
"""

from __future__ import annotations

from typing import Any

__all__ = ["BUDGET_HEADER", "budget_metadata", "waited_s"]

#: The call's deadline budget in milliseconds, as the client set it.
BUDGET_HEADER = "opentinker-timeout-ms"


def budget_metadata(timeout_s: float | None) -> tuple[tuple[str, str], ...]:
    """The metadata entry for a call made with ``timeout_s`` seconds (none without a timeout)."""
    if timeout_s is None:
        return ()
    return ((BUDGET_HEADER, str(max(0, int(timeout_s * 1000)))),)


def waited_s(context: Any) -> float | None:
    """Seconds the call of ``context`` (a ``grpc.aio.ServicerContext``) spent between reaching
    the server and now, or None when the client sent no budget (or no deadline)."""
    budget = None
    for key, value in context.invocation_metadata() or ():
        if key == BUDGET_HEADER:
            budget = value
            break
    if budget is None:
        return None
    left = context.time_remaining()
    if left is None:
        return None
    try:
        return max(0.0, int(budget) / 1000 - left)
    except ValueError:
        return None
