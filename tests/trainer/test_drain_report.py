"""A drained attempt's hand-back report says what was actually saved: the step of the checkpoint
the worker wrote on its way out, or, when the worker was killed at ``--kill-grace`` first, that it
wrote none and which checkpoint (if any) the task still has. An exit checkpoint whose storing
outlasts the grace is waited for, not cut off.

The node agent's real stop path (SIGTERM to the process group, SIGKILL after the grace, the
watcher, the final report) runs against a STAND-IN worker process: a few lines of Python that
speak the worker's JSON-line protocol, so the test controls whether it checkpoints in time."""

from __future__ import annotations

import asyncio
import sys
import textwrap

from opentinker.common.v1 import common_pb2 as C
from opentinker_trainer.agent import AgentConfig, NodeAgent, _Worker

# STAND-IN worker: reports its start; on SIGTERM either checkpoints and stops (``obliging``), or
# does so after storing its checkpoint for longer than the grace (``uploading``: a large
# checkpoint, a slow store), or ignores it, as a worker busy in a long step does, until the
# agent's SIGKILL.
_WORKER = textwrap.dedent(
    """
    import json, signal, sys, time
    obliging = sys.argv[1] in ("obliging", "uploading")
    def say(**msg):
        print(json.dumps(msg), flush=True)
    def on_term(*_):
        if sys.argv[1] == "uploading":
            say(type="phase", phase="storing exit checkpoint", detail="step 7")
            time.sleep(1.5)  # five times the grace
        if obliging:
            say(type="checkpoint", step=7, path="/tmp/ckpt-7", final=False, time=time.time())
            say(type="stopped")
            sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    say(type="started")
    while True:
        time.sleep(0.05)
    """
)


def _drain_one(tmp_path, behaviour: str, *, resume_step: int = 0) -> tuple[int, str]:
    """Run the stand-in worker under a draining agent with a 0.3 s kill grace; the final report's
    (state, error)."""

    async def scenario():
        agent = NodeAgent(AgentConfig(target="127.0.0.1:1", node_id="n1", work_dir=tmp_path, kill_grace_s=0.3))
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _WORKER, behaviour, stdout=asyncio.subprocess.PIPE, start_new_session=True
        )
        w = _Worker("t1", 2, proc, (), resume_step=resume_step)
        agent.workers["t1"] = w
        started = await proc.stdout.readline()  # its signal handler is set; the watcher reads the rest
        assert b"started" in started
        w.watcher = asyncio.create_task(agent._watch(w))
        agent.draining = True
        agent._terminate(w, None)
        await asyncio.wait_for(w.watcher, 60)
        finals = [r for r in agent._unacked.values() if r.state != C.TASK_STATE_UNSPECIFIED]
        assert len(finals) == 1
        return finals[0].state, finals[0].error

    return asyncio.run(scenario())


def test_a_worker_that_checkpoints_in_time_is_reported_with_its_step(tmp_path) -> None:
    state, error = _drain_one(tmp_path, "obliging")
    assert state == C.TASK_STATE_CANCELLED
    assert error == "node n1 drained; checkpointed at step 7 and handed back"


def test_a_worker_storing_its_exit_checkpoint_past_the_grace_is_waited_for(tmp_path) -> None:
    state, error = _drain_one(tmp_path, "uploading")
    assert state == C.TASK_STATE_CANCELLED
    assert error == "node n1 drained; checkpointed at step 7 and handed back"
    reports = _cancel_one(tmp_path, "uploading")
    assert [r.checkpoint.step for r in reports if r.HasField("checkpoint")] == [7]
    assert not [r for r in reports if r.HasField("phase") and r.phase.phase == "killed"]


def test_a_worker_killed_at_kill_grace_is_not_reported_as_checkpointed(tmp_path) -> None:
    state, error = _drain_one(tmp_path, "stubborn")
    assert state == C.TASK_STATE_CANCELLED
    assert "checkpointed and handed back" not in error
    assert error == (
        "node n1 drained; the worker was killed after --kill-grace (0.3 s) before it wrote a checkpoint; "
        "handed back (no checkpoint was written)"
    )
    _, error = _drain_one(tmp_path, "stubborn", resume_step=5)
    assert error.endswith("handed back (the newest checkpoint is step 5, which this attempt resumed from)")


def _cancel_one(tmp_path, behaviour: str) -> list:
    """The stand-in worker cancelled by the user (not a drain), 0.3 s kill grace: every report
    the agent sent after the start, in order."""

    async def scenario():
        agent = NodeAgent(AgentConfig(target="127.0.0.1:1", node_id="n1", work_dir=tmp_path, kill_grace_s=0.3))
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _WORKER, behaviour, stdout=asyncio.subprocess.PIPE, start_new_session=True
        )
        w = _Worker("t1", 1, proc, ())
        agent.workers["t1"] = w
        assert b"started" in await proc.stdout.readline()
        w.watcher = asyncio.create_task(agent._watch(w))
        agent._terminate(w, "cancelled by user: enough")
        await asyncio.wait_for(w.watcher, 60)
        return list(agent._unacked.values())

    return asyncio.run(scenario())


def test_a_cancelled_worker_killed_before_its_exit_checkpoint_is_reported_as_such(tmp_path) -> None:
    reports = _cancel_one(tmp_path, "stubborn")
    phases = [r.phase for r in reports if r.HasField("phase")]
    assert [(p.phase, p.attempt, p.detail) for p in phases] == [
        ("killed", 1, "after --kill-grace (0.3 s), before its exit checkpoint; no checkpoint was written")
    ]
    final = reports[-1]
    assert (final.state, final.error) == (C.TASK_STATE_CANCELLED, "cancelled by user: enough")
    assert reports.index(next(r for r in reports if r.HasField("phase"))) < len(reports) - 1  # before the final


def test_a_cancelled_worker_that_checkpoints_in_time_reports_no_kill(tmp_path) -> None:
    reports = _cancel_one(tmp_path, "obliging")
    assert not any(r.HasField("phase") for r in reports)
    assert [r.checkpoint.step for r in reports if r.HasField("checkpoint")] == [7]
    assert reports[-1].state == C.TASK_STATE_CANCELLED
