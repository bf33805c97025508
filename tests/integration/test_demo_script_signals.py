"""``scripts/demo.py`` stops its scheduler, trainer and worker on SIGTERM and SIGHUP, as on
Ctrl-C. Its children run in their own sessions, so only the demo can stop them: a demo that dies
without clean-up leaves them running.

The demo runs for real on the tiny model; each test signals it at a different point and then
checks that no process whose command line names the demo's ``--work-dir`` is left. SIGTERM in
the middle of training: ``test_demo_dashboard_and_tracking.py`` (the same run checks the dashboard
and the trackers first).
"""

from __future__ import annotations

import signal
import sys

import pytest

from tests.support.demo import Demo, assert_nothing_left, procs_naming

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_signal_after_scheduler_start_stops_everything(tiny_model_dir, tmp_path, sig):
    work_dir = tmp_path / "demo"
    demo = Demo(tiny_model_dir, work_dir)
    try:
        demo.wait_for_line("scheduler ")
        assert procs_naming(str(work_dir)), "the scheduler's command line should name the work dir"
        demo.proc.send_signal(sig)
        rc = demo.finish()
        out = "".join(demo.output)
        assert rc == 128 + sig, out
        assert f"{signal.Signals(sig).name}: stopping the demo's processes" in out
        assert "Traceback" not in out
        assert_nothing_left(work_dir)
    finally:
        demo.kill_leftovers()
