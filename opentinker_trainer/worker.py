"""Worker process: runs one attempt of one task. ``python -m opentinker_trainer.worker ASSIGNMENT``.

The node agent starts it as a fresh interpreter (never a fork of the agent, which holds a gRPC
channel) in its own process group, with ``CUDA_VISIBLE_DEVICES`` set to the assigned GPUs.
``ASSIGNMENT`` is a file holding a serialized ``opentinker.node.v1.AssignTask``; the checkpoint
folder comes from ``--checkpoint-dir``.

Protocol to the agent: JSON lines on stdout, one object each, with ``type``:
``started``; ``phase`` (phase, detail: ``loading model`` before the first step,
``storing exit checkpoint`` before the checkpoint after a stop); ``metric``
(step, values); ``checkpoint`` (step, path, final, format, and ``artifact``: key,
manifest_sha256, total_bytes, backend once it is in the artifact store); ``checkpoint_failed``
(step, error: a checkpoint that could not be stored); and exactly one of ``succeeded``,
``stopped`` (checkpointed and returned early after SIGTERM), ``failed`` (``error``,
``retryable``). Logs go to stderr.
Before the workload runs, a ``spec.model`` or ``env_config.path`` inside the node's work folder
is refused, and so is (when ``AssignTask.local_paths_restricted``) a relative ``spec.model`` that
exists in the worker's folder (:mod:`opentinker_trainer.local_paths`). Files are created with umask 077.
SIGTERM asks the workload to checkpoint and return. A step in progress that the workload keeps a
copy before (:mod:`opentinker_trainer.workloads._keep`) is abandoned and the last completed step
stored at once, so the agent's grace period before SIGKILL bounds a save, not a step.
A task with several ranks (``gpu_count`` N > 1, or a gang member) runs them from here: this
process is local rank 0 and spawns the others (:mod:`opentinker_trainer.distributed`).
The worker dies with the agent (``PR_SET_PDEATHSIG`` on Linux; the agent passes its pid in
``OPENTINKER_AGENT_PID`` so a worker whose agent died before that took effect exits at once).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

import structlog

from opentinker.node.v1 import node_pb2
from opentinker_common.logs import configure_logging
from opentinker_common.glibc_malloc import tune_malloc
from opentinker_common.spec import SpecError, spec_from_proto

from opentinker_common.artifacts import ArtifactError

from opentinker_trainer._proc import die_with_parent
from opentinker_trainer.worker_artifacts import (
    CACHE_BYTES_ENV,
    CACHE_ENV,
    DEFAULT_CACHE_BYTES,
    ArtifactCache,
    CheckpointPublisher,
    CheckpointStoreFailed,
    fetch_checkpoint,
    open_worker_store,
)
from opentinker_trainer.context import UserError, WorkerContext
from opentinker_trainer.local_paths import check_model_not_local, check_spec_paths, private_dirs
from opentinker_trainer.tracking import open_trackers
from opentinker_trainer.workloads import run_task


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="opentinker-worker")
    parser.add_argument("assignment", type=Path)
    parser.add_argument("--checkpoint-dir", type=Path, required=True)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when GPUs are assigned)")
    args = parser.parse_args(argv)
    os.umask(0o077)  # checkpoints and datasets are this user's only (the agent sets it too)
    tune_malloc(stream_buffers=True)  # checkpoint uploads and downloads reuse their 1 MiB buffers
    configure_logging()
    assign = node_pb2.AssignTask.FromString(args.assignment.read_bytes())
    structlog.contextvars.bind_contextvars(
        task_id=assign.task_id, attempt=assign.attempt, node_id=os.environ.get("OPENTINKER_NODE_ID", "")
    )
    log = structlog.get_logger("opentinker.worker")
    device = args.device or ("cuda" if assign.device_indices else "cpu")

    # Keep the real stdout for the report protocol; anything a library prints goes to stderr.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    ctx = prepare(assign, args.checkpoint_dir, device, out, log)
    if ctx is None:
        return 1
    signal.signal(signal.SIGTERM, lambda *_: ctx.stop_now())
    return execute(ctx, assign, device, log)


def prepare(
    assign: node_pb2.AssignTask, checkpoint_dir: Path, device: str, out, log, **context: Any
) -> WorkerContext | None:
    """The :class:`WorkerContext` of one attempt: its spec checked, its ``resume_from`` and
    ``init_from`` checkpoints fetched from the artifact store, its checkpoint publisher; None
    when that failed (then the ``failed`` report went out already). ``context``: further
    :class:`WorkerContext` fields (a model host's tenant passes ``stamp``, ``tenant``, ``_lock``)."""
    try:
        spec = spec_from_proto(assign.spec)
    except SpecError as exc:
        ctx = WorkerContext(assign.task_id, assign.attempt, None, device, checkpoint_dir, out=out, **context)  # type: ignore[arg-type]
        ctx._emit("failed", error=f"invalid spec: {exc}", retryable=False)
        return None
    # Checkpoints live in the artifact store: resume and init_from come from it (through the
    # node-local cache), and every checkpoint goes into it before it is reported.
    try:
        # the attempt's credential (a model host's tenant shares the host's environment)
        env = {**os.environ, "OPENTINKER_API_KEY": assign.worker_credential} if assign.worker_credential else None
        store, settings = open_worker_store(env)
        cache = (
            ArtifactCache(
                Path(os.environ.get(CACHE_ENV) or checkpoint_dir.parent / "artifact-cache"),
                int(os.environ.get(CACHE_BYTES_ENV) or DEFAULT_CACHE_BYTES),
            )
            if store is not None
            else None
        )
        resume, init = None, None
        if assign.HasField("resume_from"):
            resume, _ = fetch_checkpoint(store, cache, assign.resume_from)
        if assign.HasField("init_checkpoint"):
            init, _ = fetch_checkpoint(store, cache, assign.init_checkpoint, fallback=False)
    except ArtifactError as exc:
        log.error("artifact store unusable", error=str(exc))
        bare = WorkerContext(assign.task_id, assign.attempt, spec, device, checkpoint_dir, out=out, **context)
        bare._emit("failed", error=f"artifact store: {exc}", retryable=exc.retryable)
        return None
    publisher = (
        CheckpointPublisher(store, assign.task_id, assign.attempt, settings, cache) if store is not None else None
    )
    return WorkerContext(
        task_id=assign.task_id,
        attempt=assign.attempt,
        spec=spec,
        device=device,
        checkpoint_dir=checkpoint_dir,
        resume_from=resume,
        init_checkpoint=init,
        init_format=assign.init_checkpoint.format,
        out=out,
        publisher=publisher,
        credential=assign.worker_credential,
        **context,
    )


def execute(ctx: WorkerContext, assign: node_pb2.AssignTask, device: str, log) -> int:
    """Run the attempt of ``ctx`` and report how it ended (exactly one of ``succeeded``,
    ``stopped``, ``failed``); the exit code a worker process returns (0 or 1)."""
    ctx._emit("started", device=device, resume_from=str(ctx.resume_from) if ctx.resume_from else None)
    try:
        # Not another task's checkpoint or the dataset cache by path (init_from, dataset_id instead).
        check_spec_paths(ctx.spec, private_dirs(ctx.checkpoint_dir))
        if assign.local_paths_restricted:  # paths.model_dirs in force: no hub-id-shaped name of a local folder
            check_model_not_local(ctx.spec.model)
        # spec.tracking: a logger whose package this node lacks fails the task here (UserError).
        ctx.tracker = open_trackers(
            ctx.spec.tracking,
            task_id=assign.task_id,
            attempt=assign.attempt,
            spec=ctx.spec.to_dict(),
            work_dir=Path(ctx.checkpoint_dir).parent,
        )
        _run(ctx, assign, device)
    except CheckpointStoreFailed as exc:
        log.error("task failed: checkpoints cannot be stored", error=str(exc))
        ctx._emit("failed", error=str(exc), retryable=False)
        return 1
    except UserError as exc:
        log.error("task failed: user error", error=str(exc))
        ctx._emit("failed", error=str(exc), retryable=False)
        return 1
    except Exception as exc:  # noqa: BLE001 - reported to the scheduler, which may retry
        log.error("task failed", error=repr(exc), traceback=traceback.format_exc())
        ctx._emit("failed", error=f"{type(exc).__name__}: {exc}", retryable=True)
        return 1
    finally:
        if ctx.tracker is not None:
            ctx.tracker.close(ok=ctx.completed)
    if ctx.should_stop() and not ctx.completed:
        ctx._emit("stopped")
    else:
        ctx._emit("succeeded")
    return 0


def _run(ctx: WorkerContext, assign: node_pb2.AssignTask, device: str) -> None:
    """Run the attempt: in this process, or as local rank 0 of a distributed task's ranks
    (:mod:`opentinker_trainer.distributed`, when the task has more than one rank)."""
    from opentinker_trainer.distributed import launch, plan_for

    plan = plan_for(assign, device)
    if plan is None:
        run_task(ctx)
    else:
        launch(ctx, plan, run_task)


if __name__ == "__main__":
    # Die with the node agent (even after its kill -9), and exit now if it is already gone.
    die_with_parent()
    sys.exit(main())
