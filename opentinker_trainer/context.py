"""What a workload sees of the world: its task, its device, and how to report.

A worker process (``python -m opentinker_trainer.worker``) builds one :class:`WorkerContext`
and hands it to the workload's ``run(ctx)``. Reports go to the node agent as JSON lines on the
worker's stdout (see :mod:`opentinker_trainer.worker`); logs go to stderr.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Mapping

from opentinker_common.spec import TaskSpecModel


class StepAbandoned(BaseException):
    """Raised inside a step that a stop abandons (:meth:`WorkerContext.stop_now`).

    A ``BaseException``, so that workload and environment code that catches ``Exception`` lets
    it through to the step loop, which then stores the last completed step.

    Attributes:
        together: raised on every rank of a distributed task at the same collective
            (:meth:`opentinker_trainer.distributed.DataParallel.agree_to_abandon`); False when
            this rank abandoned alone and still has to tell the others.
    """

    def __init__(self, *, together: bool = False) -> None:
        super().__init__()
        self.together = together


#: The phase a stopped attempt reports as it starts its exit checkpoint (``detail``: ``step N``).
#: The node agent's ``--kill-grace`` does not cut it short: it waits for that checkpoint's
#: ``checkpoint`` or ``checkpoint_failed`` line, so a large upload is stored, not lost.
STORING_PHASE = "storing exit checkpoint"

#: The context whose abandonable step this thread runs (:meth:`WorkerContext.abandonable`).
_stepping = threading.local()


def abandon_point() -> None:
    """A point where the step this thread runs may be abandoned: raises :class:`StepAbandoned`
    when it is abandonable and a stop was requested. For a model host's tenant, whose stop comes
    from another thread and no signal: the tenant's waits on its rollout, its reward calls and
    its micro-batches call it. Elsewhere, and outside such a step, it does nothing."""
    ctx = getattr(_stepping, "ctx", None)
    if ctx is not None and ctx._abandon and ctx.should_stop():
        ctx._abandon = False
        raise StepAbandoned


class UserError(Exception):
    """The task cannot succeed however often it is retried (bad model path, bad dataset ...).

    The task ends FAILED with this message and is not retried.
    """


@dataclass
class WorkerContext:
    """One attempt of one task, as its workload sees it.

    Attributes:
        task_id, attempt: identity of this attempt (fencing: reports carry both).
        spec: the validated task spec.
        device: torch device string, ``"cuda"`` when GPUs were assigned (CUDA_VISIBLE_DEVICES is
            already set to them) and ``"cpu"`` otherwise.
        checkpoint_dir: folder this attempt writes checkpoints under (``<dir>/step_<n>``).
        resume_from: checkpoint folder to resume from, or None for a fresh start.
        init_checkpoint: final checkpoint folder of the task named by ``spec.init_from`` (the
            starting point, e.g. an SFT adapter or SFT weights), or None; ``init_format`` is its
            format (``peft_lora`` or ``hf_full``). Given on resumed attempts too.
    """

    task_id: str
    attempt: int
    spec: TaskSpecModel
    device: str
    checkpoint_dir: Path
    resume_from: Path | None = None
    out: IO[str] = field(default_factory=lambda: sys.stdout)
    #: Set once the final checkpoint is written: a stop requested after that changes nothing.
    completed: bool = False
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    init_checkpoint: Path | None = None
    init_format: str = ""
    #: Puts each checkpoint into the artifact store before it is reported (None: report the path
    #: only, a worker run without a scheduler); an ``opentinker_trainer.worker_artifacts.CheckpointPublisher``.
    publisher: Any = None
    #: Live experiment tracking of ``spec.tracking`` (an ``opentinker_trainer.tracking.Trackers``),
    #: fed every metric and checkpoint as it is reported; None = none.
    tracker: Any = None
    #: Fields added to every report line: a model host's tenant stamps its lines with
    #: ``task_id`` and ``attempt`` (:mod:`opentinker_trainer.host`); empty in a worker process.
    stamp: dict[str, Any] = field(default_factory=dict)
    #: A tenant of a model host (:class:`opentinker_trainer.host.Tenant`): the shared base model
    #: and this attempt's adapter on it; None in a worker process (the workload loads its own).
    tenant: Any = None
    #: The last step of this attempt whose update is in the model, set inside that step's turn
    #: (``_loop.run_steps``); 0 before the first. A serving neighbour on a model host copies the
    #: adapter between steps and names the copy by it (``<task id>@<step>``).
    steps_done: int = 0
    #: True while a step that a stop may abandon runs (:meth:`abandonable`).
    _abandon: bool = False
    #: This attempt's credential (``AssignTask.worker_credential``, ``otw_...``): the key its
    #: calls to the scheduler carry (:meth:`scheduler_env`); "" with auth off.
    credential: str = ""

    # --- reports ---------------------------------------------------------------------------
    def _emit(self, kind: str, **payload: Any) -> None:
        line = json.dumps({"type": kind, "time": time.time(), **self.stamp, **payload}, allow_nan=False)
        with self._lock:
            self.out.write(line + "\n")
            self.out.flush()

    def emit_metric(self, step: int, values: Mapping[str, float]) -> None:
        """Report one training step's metrics (``step`` counts from 1).

        Non-finite values are dropped (JSON and Prometheus cannot carry them meaningfully).
        """
        clean = {
            k: float(v)
            for k, v in values.items()
            if v is not None and float(v) == float(v) and abs(float(v)) != float("inf")
        }
        self._emit("metric", step=int(step), values=clean)
        if self.tracker is not None:
            self.tracker.log(step, clean)

    def scheduler_env(self) -> Mapping[str, str]:
        """The environment this attempt's scheduler calls read (:mod:`opentinker_trainer.scheduler_link`):
        this process's, with ``OPENTINKER_API_KEY`` set to the attempt's credential. A model host's
        tenants share one process, so each passes its own."""
        if not self.credential:
            return os.environ
        return {**os.environ, "OPENTINKER_API_KEY": self.credential}

    def emit_checkpoint(self, step: int, path: Path, *, final: bool, fmt: str) -> dict[str, Any] | None:
        """Report a checkpoint folder written after ``step`` (format e.g. ``peft_lora``); returns
        the stored artifact (``key``, ``manifest_sha256`` ...), None without a publisher.

        With a ``publisher``, the folder is first put into the artifact store (every file stored
        and verified) and the report carries its key and manifest hash; a periodic checkpoint that
        cannot be stored is not reported (training goes on, reported as ``checkpoint_failed``).

        Raises:
            CheckpointStoreFailed: the final checkpoint, or too many in a row, could not be stored.
        """
        artifact: dict[str, Any] | None = None
        if self.publisher is not None:
            try:
                ref = self.publisher.publish(step, Path(path), final=final, fmt=fmt)
            except Exception as exc:
                failures = getattr(self.publisher, "failed_in_a_row", 0)
                self._emit("checkpoint_failed", step=int(step), error=str(exc), fatal=True, failures_in_a_row=failures)
                raise
            if ref is None:
                self._emit(
                    "checkpoint_failed",
                    step=int(step),
                    error=f"{self.publisher.last_error}; training goes on",
                    fatal=False,
                    failures_in_a_row=self.publisher.failed_in_a_row,
                )
                return None
            artifact = {
                "key": ref.key,
                "manifest_sha256": ref.manifest_sha256,
                "total_bytes": ref.total_bytes,
                "backend": self.publisher.settings.backend,
            }
        self._emit("checkpoint", step=int(step), path=str(path), final=bool(final), format=fmt, artifact=artifact)
        if self.tracker is not None:
            self.tracker.checkpoint(step, path, final)
        if final:
            self.completed = True
        return artifact

    def emit_phase(self, phase: str, detail: str = "") -> None:
        """Report what the attempt is doing before its first step (``"loading model"``, then
        ``"model loaded"``); the scheduler records it as a task event that ``opentinker watch``
        and ``logs`` print, so a long first model load is not silence."""
        self._emit("phase", phase=str(phase), detail=str(detail))

    @contextlib.contextmanager
    def loading_model(self, name: str):
        """``with ctx.loading_model(name):`` around a model load: the ``loading model`` phase
        before, ``model loaded`` with the seconds it took after (nothing more when it raises)."""
        self.emit_phase("loading model", name)
        start = time.monotonic()
        yield
        self.emit_phase("model loaded", f"{name} in {time.monotonic() - start:.1f} s")

    def emit_endpoint(self, address: str, openai_endpoint: str = "") -> None:
        """Report the ``host:port`` a server of this attempt listens on (an ``inference`` task's
        InferenceService) and the base URL of its OpenAI API, if any; the scheduler shows them as
        ``Task.endpoint`` and ``Task.openai_endpoint`` while the task runs."""
        self._emit("endpoint", address=str(address), openai_endpoint=str(openai_endpoint))

    # --- control ---------------------------------------------------------------------------
    def request_stop(self) -> None:
        """Ask the workload to checkpoint and return early (drain, preemption, timeout)."""
        self._stop.set()

    def stop_now(self) -> None:
        """Ask the workload to stop, abandoning the step in progress when it may be abandoned.

        The worker's SIGTERM handler calls it, so it runs in the main thread between two Python
        bytecodes of whatever runs there. Inside :meth:`abandonable` it raises
        :class:`StepAbandoned` there; elsewhere it only sets the stop flag, like :meth:`request_stop`.
        """
        self._stop.set()
        if self._abandon:
            self._abandon = False
            raise StepAbandoned

    @contextlib.contextmanager
    def abandonable(self):
        """``with ctx.abandonable():`` around a step that a stop may abandon: the step loop keeps
        a copy of the last completed step to store instead. Raises :class:`StepAbandoned` at once
        when a stop was requested already; later, from :meth:`stop_now` (a worker's SIGTERM) or at
        the step's next :func:`abandon_point` (a model host's tenant)."""
        self._abandon = True
        _stepping.ctx = self
        try:
            if self.should_stop():
                raise StepAbandoned
            yield
        finally:
            self._abandon = False
            _stepping.ctx = None

    def should_stop(self) -> bool:
        """True once a stop was requested; a workload checks it between steps."""
        return self._stop.is_set()

    def turn(self) -> contextlib.AbstractContextManager:
        """The span in which this attempt may use the model: a step, a checkpoint, loading.

        In a worker process the model is the attempt's own: nothing to wait for. A tenant of a
        model host waits for its round-robin turn on the shared base model, with its adapter
        active and its RNG streams in place (:meth:`opentinker_trainer.host.Tenant.turn`).
        """
        return self.tenant.turn() if self.tenant is not None else contextlib.nullcontext()
