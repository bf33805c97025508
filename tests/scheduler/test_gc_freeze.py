"""The scheduler process freezes what its start made, so the garbage collector's full passes,
which a flood of calls triggers about once a minute, skip those objects instead of holding every
owner's calls for 50-200 ms while they scan them."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from tests.support.procs import Proc, free_port, scheduler_args
from tests.support.waiting import wait_for

#: ``python -c`` code: runs ``python -m opentinker_scheduler`` with the arguments after the first,
#: and at exit writes how many objects the collector holds frozen to the file the first names.
_FROZEN_AT_EXIT = (
    "import atexit, gc, runpy, sys; out = sys.argv.pop(1); "
    "atexit.register(lambda: open(out, 'w').write(str(gc.get_freeze_count()))); "
    "runpy.run_module('opentinker_scheduler', run_name='__main__', alter_sys=True)"
)


def test_the_objects_of_the_start_are_frozen(tmp_path: Path) -> None:
    config = tmp_path / "scheduler_config.yaml"
    config.write_text("auth: {enabled: true}\n")
    http_port = free_port()
    flags = scheduler_args(
        config, port=free_port(), http_port=http_port, state_dir=tmp_path / "state", host="127.0.0.1"
    )[2:]
    out = tmp_path / "frozen"
    proc = Proc(["-c", _FROZEN_AT_EXIT, str(out), *flags], tmp_path / "scheduler.log")
    try:

        def healthy() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=2) as resp:
                    return json.loads(resp.read())["status"] == "ok"
            except OSError:
                return False

        wait_for(healthy, timeout=60, what="the scheduler answers /health")
        assert proc.terminate() == 0, proc.log_text()
    finally:
        proc.close()
    # The modules, config and servers of the start: tens of thousands of objects.
    assert int(out.read_text()) > 10_000
