"""A scheduler whose ticks meet an unreachable state store says so once, and once when it is back:
not a traceback per tick (here five ticks in a row)."""

from __future__ import annotations

from structlog.testing import capture_logs

from opentinker_scheduler.errors import StoreUnavailable

from tests.support.security import LoopbackScheduler
from tests.support.waiting import wait_for

DOWN = "tick skipped: state store unavailable; retrying each tick"
BACK = "tick: state store reachable again"


def test_a_store_outage_is_one_warning_and_one_line_when_it_ends(tmp_path, monkeypatch) -> None:
    with LoopbackScheduler(tmp_path / "state") as sched:
        tick = sched.core.tick
        failures = []

        def tick_on_a_stopped_store(**kw):
            if len(failures) < 5:
                failures.append(1)
                raise StoreUnavailable("state store unavailable: connection refused")
            tick(**kw)

        with capture_logs() as logs:
            monkeypatch.setattr(sched.core, "tick", tick_on_a_stopped_store)
            wait_for(lambda: any(e["event"] == BACK for e in logs), what="ticks after the outage")
        events = [e for e in logs if e["event"] in (DOWN, BACK, "tick failed")]
        assert [e["event"] for e in events] == [DOWN, BACK]
        assert events[0]["log_level"] == "warning" and "connection refused" in events[0]["error"]
        assert "exc_info" not in events[0]
