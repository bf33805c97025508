"""Distributed tasks: a task's ranks, their torch.distributed process group, and the collectives
the workloads use.

A task with more than one rank (``resources.gpu_count`` N > 1 on one node, or a gang of
``resources.nodes`` members) runs one process per device. The worker process the node agent
starts is this member's **local rank 0**; it starts local ranks ``1 .. L-1`` with
``torch.multiprocessing`` (``spawn``: fresh interpreters, never a fork of a process holding
threads), so every rank is in the worker's process group and a cancel or drain (SIGTERM, then
SIGKILL, to the group) reaches them all. Each rank dies with its parent (``PR_SET_PDEATHSIG``).

Ranks meet through torch.distributed's ``TCPStore`` on the rendezvous host and port
(:class:`RankPlan`; ``MASTER_ADDR`` / ``MASTER_PORT``, ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE`` are set as ``torchrun`` sets them) and form one process group: ``nccl`` when
the ranks use CUDA devices (rank ``local_rank`` on ``cuda:<local_rank>``), ``gloo`` on CPUs and on
``--simulate-gpus`` nodes, so the same code runs in the tests on CPU ranks.

Data parallelism (:class:`DataParallel`): every rank holds the whole trainable model (for LoRA,
the adapter; for a small PPO policy, the policy; full-weight SFT shards it instead with FSDP2,
:mod:`opentinker_trainer.fsdp`), computes the loss of its share of the step's
samples normalised by the *global* count (tokens, sequences, samples), and the gradients are
summed across ranks with one ``all_reduce`` of a flat buffer after the micro-batches' backward
passes (the reduction DDP performs, done once per optimizer step instead of through DDP's
wrapper: the LoRA policy is also run through PEFT's ``disable_adapter`` for the reference and
through ``generate``, which a DDP wrapper does not forward, and the micro-batch counts of the
ranks may differ). Then every rank clips and steps the same summed gradient, so the replicas
stay equal; a step of world size W on a global batch equals a step of world size 1 on the same
batch, up to float summation order (the equivalence tests). Metrics are reduced across ranks
before global rank 0 reports them; only global rank 0 writes checkpoints, with every rank's RNG
state (:func:`gather_rng_states`).

A stop (cancel, preemption, drain, max_runtime: SIGTERM to every rank) abandons the step in
progress on every rank at the same point, when the trainer keeps a copy of its last completed
step (:mod:`opentinker_trainer.workloads._keep`): inside such a step each collective of
:class:`DataParallel` first agrees whether any rank was stopped, and so does the step's end
(:meth:`DataParallel.agree_to_abandon`). A rank stopped between two collectives abandons at once
and meets the others at their next agreement (:meth:`DataParallel.abandon_with_others`), so no
rank waits in a collective for one that left. Every rank then puts back the same completed step
and rank 0 stores it.

Failure of a member: a local rank that exits or raises makes local rank 0 report the attempt
``failed`` (retryable) and end all of its ranks; a lost remote rank breaks the gloo / NCCL
connections, so the collective every other rank is in raises, and they end too. The scheduler
requeues the task as one attempt + 1 from its newest checkpoint.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing.connection
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import structlog
import torch
import torch.distributed as dist

from opentinker_trainer.context import StepAbandoned, UserError, WorkerContext

log = structlog.get_logger("opentinker.distributed")

__all__ = [
    "DISTRIBUTED_TRAINERS",
    "DataParallel",
    "RankContext",
    "RankPlan",
    "gather_rng_states",
    "launch",
    "per_rank_count",
    "plan_for",
    "rank_context",
    "restore_rank_rng",
    "save_once",
    "seed_rank",
    "shard",
    "world",
]

#: ``(workload_type, env kind)`` of the trainers that run data-parallel over several ranks. A
#: task of another trainer given several devices runs one rank on the first of them.
DISTRIBUTED_TRAINERS = frozenset(
    {
        ("lora_finetune", "text"),  # GRPO, LoRA adapter replicated, rollout groups sharded
        ("lora_finetune", "gym"),  # GRPO on an LM game, LoRA adapter replicated, groups of episodes sharded
        ("full_rl", "text"),  # GRPO on all weights sharded with FSDP2 (fsdp.py), rollout groups sharded
        ("sft", "dataset"),  # examples of each batch sharded; all weights sharded with FSDP2 (fsdp.py)
        ("full_rl", "gym"),  # PPO: each rank steps its share of the vector envs
        ("full_rl", "multiagent"),  # multi-agent PPO: each rank steps its share of the env copies
    }
)

#: How long ranks wait for each other at the rendezvous and in a collective before giving up.
DEFAULT_TIMEOUT_S = 600.0

#: Exit code of a local rank whose workload raised :class:`UserError` (not worth a retry).
_USER_ERROR_EXIT = 3


@dataclass(frozen=True)
class RankPlan:
    """Where this member's ranks sit in the task's process group.

    Attributes:
        world_size: ranks of the whole task.
        rank_offset: global rank of this member's local rank 0.
        local_world_size: ranks this member runs (one per assigned device).
        rendezvous_host, rendezvous_port: the ``TCPStore`` of global rank 0 (port 0: member 0
            picks a free port; only for a one-member task).
        cuda: the ranks use CUDA devices (backend ``nccl``), else CPUs (``gloo``).
        member_index, members: this member's index among the task's nodes, and their number.
    """

    world_size: int
    rank_offset: int
    local_world_size: int
    rendezvous_host: str = "127.0.0.1"
    rendezvous_port: int = 0
    cuda: bool = False
    member_index: int = 0
    members: int = 1

    @property
    def backend(self) -> str:
        """``nccl`` for CUDA ranks, ``gloo`` for CPU ranks."""
        return "nccl" if self.cuda else "gloo"

    def device(self, local_rank: int) -> str:
        """The torch device of ``local_rank``: ``cuda:<local_rank>`` or ``cpu``."""
        return f"cuda:{local_rank}" if self.cuda else "cpu"


def plan_for(assign: Any, device: str) -> RankPlan | None:
    """The :class:`RankPlan` of an ``AssignTask``, or None for a one-rank attempt.

    A one-node task runs as many ranks as it was given devices (``device_indices``, simulated
    ones included) when its trainer is one of :data:`DISTRIBUTED_TRAINERS`; a gang member follows
    ``assign.gang``. ``device`` is the worker's device (``cuda`` or ``cpu``).

    Raises:
        UserError: a gang task whose trainer cannot run distributed (the scheduler placed it on
            several nodes, so running one rank would be wrong).
    """
    from opentinker_common.spec import env_kind, spec_from_proto

    spec = spec_from_proto(assign.spec)
    kind = (spec.workload_type, env_kind(spec.env))
    cuda = device.startswith("cuda")
    if assign.HasField("gang") and assign.gang.world_size > 1:
        g = assign.gang
        if kind not in DISTRIBUTED_TRAINERS:
            raise UserError(
                f"spec.resources.nodes {g.members}: workload {kind[0]!r} on {kind[1]!r} environments "
                "cannot run distributed; use one node"
            )
        return RankPlan(
            world_size=int(g.world_size),
            rank_offset=int(g.rank_offset),
            local_world_size=int(g.local_world_size),
            rendezvous_host=g.rendezvous_host or "127.0.0.1",
            rendezvous_port=int(g.rendezvous_port),
            cuda=cuda,
            member_index=int(g.member_index),
            members=max(1, int(g.members)),
        )
    n = len(assign.device_indices)
    if n <= 1 or kind not in DISTRIBUTED_TRAINERS:
        if n > 1:
            log.warning("trainer runs one rank; only the first assigned device is used", workload=kind[0], devices=n)
        return None
    return RankPlan(world_size=n, rank_offset=0, local_world_size=n, cuda=cuda)


# --------------------------------------------------------------------------------------------
# Collectives the workloads use.


def shard(n: int, rank: int, world_size: int) -> range:
    """This rank's contiguous share of ``n`` items: sizes differ by at most one, lower ranks
    take the larger shares (``numpy.array_split``'s rule). ``shard(5, 0, 2) = range(0, 3)``."""
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


class DataParallel:
    """The collectives of one rank of a data-parallel task (an initialised default process group).

    Attributes:
        rank, world_size: torch.distributed's (global).
        local_rank: rank within this member (node).
        device: this rank's torch device.
    """

    def __init__(self, rank: int, world_size: int, local_rank: int = 0, device: str = "cpu") -> None:
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.device = torch.device(device)
        #: The rank's context (:func:`rank_context` sets it). Inside a step that a stop may
        #: abandon (``WorkerContext.abandonable``) each collective first agrees with the other
        #: ranks whether to abandon it (:meth:`agree_to_abandon`).
        self.ctx: WorkerContext | None = None

    # --- abandoning a step together -------------------------------------------------------
    def _stopped_anywhere(self, stopped: bool) -> bool:
        t = torch.tensor([1.0 if stopped else 0.0], dtype=torch.float64, device=self._comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item() > 0)

    def agree_to_abandon(self) -> None:
        """Inside an abandonable step: learn whether any rank was stopped (one ``all_reduce``), and
        if one was, raise :class:`~opentinker_trainer.context.StepAbandoned` (``together``) here on
        every rank. From here on a SIGTERM only sets the stop flag; the collective that follows
        re-arms it. Outside such a step, nothing. The step loop calls it once more after the
        step's copy is taken: a step counts as completed on every rank or on none."""
        ctx = self.ctx
        if ctx is None or not ctx._abandon:
            return
        ctx._abandon = False
        if self._stopped_anywhere(ctx.should_stop()):
            raise StepAbandoned(together=True)

    def abandon_with_others(self) -> None:
        """After this rank abandoned its step alone (stopped between two agreements): meet the
        other ranks at their next :meth:`agree_to_abandon`, where they abandon the step too."""
        self._stopped_anywhere(True)

    @contextlib.contextmanager
    def _collective(self):
        """Around each collective: agree first (:meth:`agree_to_abandon`); after it, abandon at
        once on a stop that came meanwhile."""
        ctx = self.ctx
        if ctx is None or not ctx._abandon:
            yield
            return
        self.agree_to_abandon()
        yield
        ctx._abandon = True
        if ctx.should_stop():
            ctx._abandon = False
            raise StepAbandoned

    def shard(self, n: int) -> range:
        """This rank's share of ``n`` items (:func:`shard`)."""
        return shard(n, self.rank, self.world_size)

    def sum(self, *values: float) -> list[float]:
        """Element-wise sums over ranks of ``values`` (floats), one ``all_reduce`` in float64."""
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self._comm_device)
        with self._collective():
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return [float(x) for x in t.cpu()]

    def sum_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over ranks (a new tensor on ``t``'s device and dtype)."""
        out = t.detach().to(self._comm_device, torch.float64 if t.is_floating_point() else torch.int64).clone()
        with self._collective():
            dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out.to(t.device, t.dtype)

    def max(self, *values: float) -> list[float]:
        """Element-wise maxima over ranks of ``values``."""
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self._comm_device)
        with self._collective():
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [float(x) for x in t.cpu()]

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on any rank."""
        return self.max(1.0 if flag else 0.0)[0] > 0

    def all_reduce_grads(self, params: Sequence[torch.Tensor]) -> None:
        """Sum the ``.grad`` of ``params`` over ranks, in place (a missing grad counts as zeros and
        is created), with one ``all_reduce`` of a flat buffer per dtype."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            by_dtype.setdefault(p.grad.dtype, []).append(p)
        for group in by_dtype.values():
            flat = torch.cat([p.grad.reshape(-1) for p in group]).to(self._comm_device)
            with self._collective():
                dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            offset = 0
            for p in group:
                n = p.grad.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
                offset += n

    def broadcast(self, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
        """Make every rank's ``tensors`` (parameters, buffers) equal to rank ``src``'s, in place."""
        with torch.no_grad():
            for t in tensors:
                buf = t.detach().to(self._comm_device).clone()
                with self._collective():
                    dist.broadcast(buf, src=src)
                t.copy_(buf.to(t.device))

    def gather_objects(self, obj: Any) -> list[Any]:
        """``obj`` of every rank, in rank order, on every rank (picklable objects)."""
        out: list[Any] = [None] * self.world_size
        with self._collective():
            dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        with self._collective():
            dist.barrier()

    @property
    def _comm_device(self) -> torch.device:
        # NCCL moves CUDA tensors only; gloo CPU ones.
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")


def save_once(ctx: WorkerContext, write: Callable[[dict[str, Any]], Path], *, step: int, final: bool, fmt: str) -> Path:
    """A checkpoint of a possibly distributed attempt: global rank 0 calls ``write(extra)``, where
    ``extra`` is ``{"rng_ranks": [rank 0's RNG states, rank 1's ...], "world_size": W}`` (empty for
    one rank) to store in its ``trainer_state.pt``, and reports it; the other ranks only note a
    final one. A collective (every rank calls it after the same step); ends with a barrier, so no
    rank runs ahead of a half-written checkpoint.

    Returns:
        The checkpoint folder (``<checkpoint_dir>/step_<step>``, also on ranks that did not write).
    """
    dp = world(ctx)
    if dp is None:
        return write({})
    states = gather_rng_states(ctx)
    if dp.rank == 0:
        path = write({"rng_ranks": states, "world_size": dp.world_size})
    else:
        path = Path(ctx.checkpoint_dir) / f"step_{step}"
        ctx.emit_checkpoint(step, path, final=final, fmt=fmt)
    dp.barrier()
    return path


def world(ctx: WorkerContext) -> DataParallel | None:
    """The :class:`DataParallel` of a rank's context, or None for a one-rank attempt."""
    return getattr(ctx, "dist", None)


def gather_rng_states(ctx: WorkerContext) -> list[dict[str, Any]] | None:
    """Every rank's global RNG states (``_rng.rng_state``), in rank order; None for one rank.
    A collective: every rank calls it, at the same point."""
    from opentinker_trainer.workloads import _rng

    dp = world(ctx)
    return None if dp is None else dp.gather_objects(_rng.rng_state())


def restore_rank_rng(ctx: WorkerContext, state: dict[str, Any], *, reseed: int) -> None:
    """Restore this rank's RNGs from a checkpoint's ``trainer_state`` (after the trainer restored
    rank 0's from ``state["rng"]``): ``state["rng_ranks"][rank]`` when the checkpoint was written
    by as many ranks or more (exact resume with the same world size); otherwise rank ``r > 0``
    reseeds torch, numpy and Python with ``reseed + r`` (a resume at another world size works but
    is not bit-exact). Does nothing for one rank."""
    from opentinker_trainer.workloads import _rng

    dp = world(ctx)
    if dp is None:
        return
    ranks = state.get("rng_ranks") or []
    if dp.rank < len(ranks) and len(ranks) == dp.world_size:
        _rng.restore_rng_state(ranks[dp.rank])
    elif dp.rank > 0:
        seed_rank(reseed, dp.rank)


def seed_rank(seed: int, rank: int) -> None:
    """Seed torch, numpy and Python with ``seed + rank`` (each rank samples its own stream)."""
    import random

    import numpy as np

    random.seed(seed + rank)
    np.random.seed((seed + rank) % 2**32)
    torch.manual_seed(seed + rank)


# --------------------------------------------------------------------------------------------
# The context of a rank.


class _Discard:
    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


class RankContext(WorkerContext):
    """The :class:`WorkerContext` of one rank. Only global rank 0 reports metrics, checkpoints and
    endpoints; each member's local rank 0 still reports its own start and outcome (the worker does,
    on ``out``). Stop requests are agreed across ranks at step boundaries (:meth:`stop_together`).
    """

    dist: DataParallel

    def emit_metric(self, step: int, values) -> None:
        if self.dist.rank == 0:
            super().emit_metric(step, values)

    def emit_checkpoint(self, step: int, path: Path, *, final: bool, fmt: str) -> None:
        if self.dist.rank == 0:
            super().emit_checkpoint(step, path, final=final, fmt=fmt)
        elif final:
            self.completed = True

    def emit_endpoint(self, address: str, openai_endpoint: str = "") -> None:
        if self.dist.rank == 0:
            super().emit_endpoint(address, openai_endpoint)

    def stop_together(self) -> bool:
        """True on every rank when a stop was requested on any rank (a collective: the step loop
        calls it at the same points on every rank). Sets the local stop flag too."""
        if self.dist.any(self.should_stop()):
            self.request_stop()
            return True
        return False


def rank_context(ctx: WorkerContext, dp: DataParallel, *, out: Any = None) -> RankContext:
    """A :class:`RankContext` with the fields of ``ctx``, its collectives ``dp``, device
    ``dp.device`` and report stream ``out`` (default ``ctx.out``)."""
    rc = RankContext(
        task_id=ctx.task_id,
        attempt=ctx.attempt,
        spec=ctx.spec,
        device=str(dp.device),
        checkpoint_dir=ctx.checkpoint_dir,
        resume_from=ctx.resume_from,
        out=ctx.out if out is None else out,
        init_checkpoint=ctx.init_checkpoint,
        init_format=ctx.init_format,
    )
    rc.publisher = ctx.publisher  # global rank 0 stores its checkpoints in the artifact store first
    rc._stop = ctx._stop  # a stop asked of ``ctx`` is this rank's too
    rc._lock = ctx._lock
    rc.dist = dp
    dp.ctx = rc
    return rc


# --------------------------------------------------------------------------------------------
# Starting the ranks.


def _torchrun_env(plan: RankPlan, local_rank: int, port: int) -> None:
    os.environ.update(
        {
            "MASTER_ADDR": plan.rendezvous_host,
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(plan.world_size),
            "LOCAL_WORLD_SIZE": str(plan.local_world_size),
            "RANK": str(plan.rank_offset + local_rank),
            "LOCAL_RANK": str(local_rank),
            "GROUP_RANK": str(plan.member_index),
        }
    )


def _init_group(plan: RankPlan, local_rank: int, store: Any, timeout_s: float) -> DataParallel:
    rank = plan.rank_offset + local_rank
    device = plan.device(local_rank)
    if plan.cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group(
        plan.backend,
        store=store,
        rank=rank,
        world_size=plan.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return DataParallel(rank, plan.world_size, local_rank, device)


def _store(plan: RankPlan, port: int, is_master: bool, timeout_s: float):
    return dist.TCPStore(
        plan.rendezvous_host,
        port,
        plan.world_size,
        is_master=is_master,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def _rank_main(
    i: int,
    plan: RankPlan,
    port: int,
    fields: dict[str, Any],
    target: Callable[[WorkerContext], None],
    errors: Any,
    timeout_s: float,
    parent_pid: int,
) -> None:
    """Entry of local rank ``i + 1`` (a spawned child of local rank 0, whose pid is ``parent_pid``)."""
    from opentinker_common.logs import configure_logging
    from opentinker_trainer._proc import die_with_parent

    die_with_parent(expected_parent=parent_pid)
    local_rank = i + 1
    os.umask(0o077)
    configure_logging()
    structlog.contextvars.bind_contextvars(
        task_id=fields["task_id"], attempt=fields["attempt"], rank=plan.rank_offset + local_rank
    )
    _torchrun_env(plan, local_rank, port)
    base = WorkerContext(**fields, device=plan.device(local_rank), out=_Discard())
    signal.signal(signal.SIGTERM, lambda *_: base.request_stop())
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        store = _store(plan, port, False, timeout_s)
        dp = _init_group(plan, local_rank, store, timeout_s)
        rc = rank_context(base, dp)
        signal.signal(signal.SIGTERM, lambda *_: rc.stop_now())  # abandons a step, as in local rank 0
        target(rc)
        dist.destroy_process_group()
    except UserError as exc:
        errors.put((local_rank, str(exc), False))
        os._exit(_USER_ERROR_EXIT)
    except BaseException as exc:  # noqa: BLE001 - reported by local rank 0
        log.error("rank failed", error=repr(exc), traceback=traceback.format_exc())
        errors.put((local_rank, f"{type(exc).__name__}: {exc}", True))
        os._exit(1)


class _Watchdog(threading.Thread):
    """Watches local ranks ``1 .. L-1``; on one's unexpected end, reports the attempt failed and
    ends every rank of this member (this process included)."""

    def __init__(self, ctx: WorkerContext, procs: list, errors: Any, plan: RankPlan) -> None:
        super().__init__(name="rank-watchdog", daemon=True)
        self.ctx, self.procs, self.errors, self.plan = ctx, procs, errors, plan
        self.done = threading.Event()
        #: ``local rank -> exit code`` of every child this thread reaped (read by :func:`_lost_rank`:
        #: once this thread has reaped a child, another ``waitpid`` on it learns nothing).
        self.exitcodes: dict[int, int] = {}

    def run(self) -> None:
        live = {p.sentinel: (i + 1, p) for i, p in enumerate(self.procs)}
        while live and not self.done.is_set():
            ready = multiprocessing.connection.wait(list(live), timeout=0.5)
            for s in ready:
                local_rank, p = live.pop(s)
                p.join()
                self.exitcodes[local_rank] = p.exitcode
                if p.exitcode == 0 or self.done.is_set():
                    continue
                self._fail(local_rank, p)
                return

    def _fail(self, local_rank: int, p) -> None:
        rank = self.plan.rank_offset + local_rank
        error, retryable = None, True
        with contextlib.suppress(Exception):
            while not self.errors.empty():
                r, message, retry = self.errors.get()
                if r == local_rank:
                    error, retryable = message, retry
        if error is None:
            how = f"killed by signal {-p.exitcode}" if p.exitcode < 0 else f"exited with code {p.exitcode}"
            error = f"rank {rank} (pid {p.pid}) {how}"
        else:
            error = f"rank {rank}: {error}"
        log.error("a rank ended; ending the attempt", rank=rank, error=error)
        self.ctx._emit("failed", error=error, retryable=retryable)
        _kill(self.procs)
        os._exit(1)


def _kill(procs: list) -> None:
    for p in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
            if p.exitcode is None:
                os.kill(p.pid, signal.SIGKILL)


def launch(
    ctx: WorkerContext,
    plan: RankPlan,
    target: Callable[[WorkerContext], None],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> None:
    """Run ``target`` (a trainer's ``run(ctx)``) on this member's ranks: local rank 0 in this
    process with a :class:`RankContext` over ``ctx``, local ranks 1..L-1 in spawned children.

    Member 0 hosts the rendezvous (``TCPStore``) on ``plan.rendezvous_port``, or a free port of
    127.0.0.1 when it is 0. Returns once every local rank has finished.

    Raises:
        UserError: the workload raised it on this rank.
        Exception: whatever the workload raised on local rank 0 (the children are then killed).
        RuntimeError: a child ended without finishing (after rank 0 did).
    """
    import torch.multiprocessing as mp

    if plan.cuda and torch.cuda.device_count() < plan.local_world_size:
        raise RuntimeError(
            f"{plan.local_world_size} ranks need as many CUDA devices; "
            f"{torch.cuda.device_count()} visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
        )
    master = plan.rank_offset == 0
    store = _store(plan, plan.rendezvous_port, master, timeout_s)
    port = store.port if master else plan.rendezvous_port
    log.info(
        "starting ranks",
        world_size=plan.world_size,
        ranks=f"{plan.rank_offset}..{plan.rank_offset + plan.local_world_size - 1}",
        backend=plan.backend,
        rendezvous=f"{plan.rendezvous_host}:{port}",
        member=plan.member_index,
        members=plan.members,
    )
    _torchrun_env(plan, 0, port)
    fields = {
        "task_id": ctx.task_id,
        "attempt": ctx.attempt,
        "spec": ctx.spec,
        "checkpoint_dir": ctx.checkpoint_dir,
        "resume_from": ctx.resume_from,
        "init_checkpoint": ctx.init_checkpoint,
        "init_format": ctx.init_format,
    }
    mpctx = mp.get_context("spawn")
    errors = mpctx.SimpleQueue()
    procs = []
    for i in range(plan.local_world_size - 1):
        p = mpctx.Process(
            target=_rank_main,
            args=(i, plan, port, fields, target, errors, timeout_s, os.getpid()),
            name=f"rank-{i + 1}",
        )
        p.start()
        procs.append(p)
    watchdog = _Watchdog(ctx, procs, errors, plan)
    watchdog.start()
    try:
        dp = _init_group(plan, 0, store, timeout_s)
        rc = rank_context(ctx, dp)
        # The worker's SIGTERM handler stops ``ctx``; a step in progress is this rank's to abandon.
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, lambda *_: rc.stop_now())
        target(rc)
        ctx.completed = rc.completed
        watchdog.done.set()
        for p in procs:
            p.join()
        failed = [p for p in procs if p.exitcode != 0]
        if failed:
            raise RuntimeError(f"local rank(s) {[procs.index(p) + 1 for p in failed]} ended without finishing")
        dist.destroy_process_group()
    except BaseException as exc:
        watchdog.done.set()
        # A collective that broke because a local rank died: say which rank, not only gloo's words.
        lost = _lost_rank(procs, plan, watchdog.exitcodes)
        _kill(procs)
        if lost is not None and not isinstance(exc, UserError):
            raise RuntimeError(f"{lost}; the other ranks' collective broke ({type(exc).__name__})") from exc
        raise


def _lost_rank(procs: list, plan: RankPlan, reaped: dict[int, int], wait_s: float = 5.0) -> str | None:
    """``"rank R (pid P) killed by signal S"`` of the first local rank a signal ended, waiting up
    to ``wait_s`` seconds for one to finish dying; None when none did (a rank that raised exits
    with a code: most likely the same broken collective, e.g. after a remote member was lost).

    ``reaped``: exit codes the watchdog thread already collected (``local rank -> code``). A child
    is reaped once: when the watchdog's ``waitpid`` won, this thread's sees no status, so the code
    is read from there. The wait ends early once every child's end is known."""
    deadline = time.monotonic() + wait_s

    def code(i: int, p) -> int | None:
        c = p.exitcode
        return c if c is not None else reaped.get(i + 1)

    while True:
        codes = [code(i, p) for i, p in enumerate(procs)]
        for i, c in enumerate(codes):
            if c is not None and c < 0:
                return f"rank {plan.rank_offset + i + 1} (pid {procs[i].pid}) killed by signal {-c}"
        left = deadline - time.monotonic()
        if all(c is not None for c in codes) or left <= 0:
            return None
        live = [p.sentinel for p, c in zip(procs, codes) if c is None]
        # A ready sentinel may precede the status by a moment (waitpid in the other thread):
        # wait at most 50 ms at a time and look again.
        if multiprocessing.connection.wait(live, timeout=min(left, 0.05)):
            time.sleep(0.005)


def per_rank_count(total: int, dp: DataParallel | None, field: str) -> int:
    """This rank's share of ``total`` items that must divide evenly across ranks (vector envs).

    Raises:
        UserError: ``total`` is not a multiple of the world size (``field`` names the setting).
    """
    if dp is None:
        return total
    if total % dp.world_size:
        raise UserError(
            f"{field} {total}: must be a multiple of the task's world size {dp.world_size} "
            "(each rank runs an equal share)"
        )
    return total // dp.world_size
