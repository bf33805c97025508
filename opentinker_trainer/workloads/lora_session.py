"""``lora_session``: a training session whose endpoint serves ``TrainingService`` (docs/primitives.md).

Loads the base model and a fresh LoRA adapter (``lora_rank`` / ``lora_alpha`` /
``target_modules``, initialised after ``torch.manual_seed(seed)`` as every LoRA trainer does), or
with ``lora: false`` the base model with every weight trainable (states are then ``hf_full``
checkpoints: all weights, the tokenizer and ``trainer_state.pt``), or the state it resumes
from (``ctx.resume_from``, the newest ``SaveState`` of the task: adapter or weights, AdamW
state, step and the next sequence number); starts a grpc.aio server on
``hyperparameters.port`` (0 = any free port), reports each optimizer step's metrics (loss,
tokens trained and sampled, gradient norm: the task's curve and usage), reports ``host:port``
upward (``ctx.emit_endpoint``; the scheduler shows it as ``Task.endpoint``) and serves until
the task is cancelled or stopped (SIGTERM -> ``ctx.should_stop()``), or no call came for
``idle_timeout_s`` seconds (the task then ends SUCCEEDED). ``max_runtime`` is the scheduler's, as for any task.

Security and TLS as the ``inference`` workload (:mod:`opentinker_trainer.workloads.serving`): with
``OPENTINKER_SCHEDULER_URL`` set every call is checked against the scheduler with the
caller's endpoint token, so only the task's owner (or an admin) may use the session; with
``OPENTINKER_SERVE_TLS_CERT`` / ``_KEY`` the port speaks TLS and the endpoint is ``https://``.

On a model host (:mod:`opentinker_trainer.host`; ``ctx.tenant`` set) the session is a tenant: its
adapter is one of the host's on the base model the host loaded once (fresh from the seed, or the
state it resumes from, as above), its optimizer is over that adapter alone, and every call that uses
the model runs in its turn (:class:`~opentinker_trainer.training.session.TrainingSession`'s
``turn``), between its neighbours' steps and serving turns; its server runs in the host process.

States (``SaveState``) are written under ``ctx.checkpoint_dir`` and put into the artifact store
before they are reported as checkpoints of the task (format ``peft_lora``).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import torch

from opentinker_common.artifacts import ArtifactError, ArtifactNotFound, ArtifactRef

from opentinker_trainer.context import UserError, WorkerContext
from opentinker_trainer.inference.access import AccessChecker
from opentinker_trainer.inference.serve_tls import server_tls_from_env
from opentinker_trainer.training.datums import Limits
from opentinker_trainer.training.errors import NotReady, StateNotFound, Stopping
from opentinker_trainer.training.sequencing import Sequencer
from opentinker_trainer.training.server import TrainingServicer, start_training_server
from opentinker_trainer.training.session import TrainingSession
from opentinker_trainer.workloads import _lm
from opentinker_trainer.workloads.serving import auth_ttl

log = _lm.get_logger("opentinker.trainer.lora_session")

__all__ = ["open_session", "run"]

#: Seconds between checks for a stop request or the idle timeout.
POLL_S = 0.2


def open_session(ctx: WorkerContext) -> tuple[TrainingSession, int]:
    """``(session, next sequence number)`` of this attempt: fresh, or resumed from ``ctx.resume_from``.

    Raises:
        UserError: the model, the state resumed from or the init_state cannot be loaded.
    """
    cfg = ctx.spec.hyperparameters
    tenant = getattr(ctx, "tenant", None)
    shared: dict = {}
    if tenant is not None:  # a model host's tenant: the host's base with this attempt's adapter
        with ctx.turn():
            tokenizer, model = tenant.attach(cfg)
        shared = {"params": tenant.parameters(), "adapter_name": tenant.name, "turn": ctx.turn}
    else:
        device = torch.device(ctx.device)
        dtype = _lm.resolve_dtype(cfg.dtype, device)
        tokenizer, model = _lm.load_for_training(ctx, cfg, device, dtype, full=not cfg.lora)
    fmt = _lm.FORMAT_LORA if cfg.lora else _lm.FORMAT_FULL

    def publish(step: int, folder: Path, kind: str) -> str:
        artifact = ctx.emit_checkpoint(step, folder, final=False, fmt=fmt)
        if ctx.publisher is not None and artifact is None:
            raise Stopping(f"state at step {step}: the artifact store did not take it; nothing was recorded, try again")
        return (artifact or {}).get("key", "")

    session = TrainingSession(
        model,
        tokenizer,
        model_name=ctx.spec.model,
        lora=(
            {"lora_rank": cfg.lora_rank, "lora_alpha": cfg.lora_alpha, "target_modules": list(cfg.target_modules)}
            if cfg.lora
            else None
        ),
        limits=Limits(cfg.max_datums_per_call, cfg.max_tokens_per_call, cfg.max_in_flight_calls),
        micro_batch_tokens=cfg.micro_batch_tokens,
        checkpoint_dir=Path(ctx.checkpoint_dir),
        publish=publish,
        report=ctx.emit_metric,
        fetch_state=_state_fetcher(ctx),
        **shared,
    )
    if ctx.resume_from is not None:
        return session, session.adopt(Path(ctx.resume_from))
    if cfg.init_state:
        if ctx.init_checkpoint is None:
            raise UserError(f"init_state: state {cfg.init_state!r} of task {ctx.spec.init_from} is gone from the store")
        session.start_from(Path(ctx.init_checkpoint), with_optimizer=cfg.init_optimizer)
    return session, 0


def _state_fetcher(ctx: WorkerContext):
    """``(key, manifest SHA-256, bytes) -> folder`` of another task's state, read from the artifact
    store with the attempt's credential (so only its owner's tasks) through the node's cache;
    None without a store."""
    publisher = ctx.publisher
    if publisher is None or publisher.cache is None:
        return None

    def fetch(key: str, manifest_sha256: str, total_bytes: int) -> Path:
        try:
            return publisher.cache.fetch(publisher.store, ArtifactRef(key, manifest_sha256, total_bytes))
        except ArtifactNotFound:
            raise StateNotFound(f"state {key!r}: not in the artifact store (deleted, or not yours)") from None
        except ArtifactError as exc:
            raise NotReady(f"state {key!r}: the artifact store could not give it: {exc}; try again") from None

    return fetch


def run(ctx: WorkerContext) -> None:
    tls = server_tls_from_env()
    log.info("loading model", task_id=ctx.task_id, model=ctx.spec.model, device=ctx.device, resume=str(ctx.resume_from))
    session, next_sequence = open_session(ctx)
    scheduler = os.environ.get("OPENTINKER_SCHEDULER_URL")
    asyncio.run(_serve(ctx, session, next_sequence, tls=tls, access_ttl=auth_ttl() if scheduler else None))


async def _serve(ctx: WorkerContext, session: TrainingSession, next_sequence: int, *, tls, access_ttl) -> None:
    cfg = ctx.spec.hyperparameters
    last = [time.monotonic()]

    def touch() -> None:
        last[0] = time.monotonic()

    servicer = TrainingServicer(
        session,
        sequencer=Sequencer(
            next_sequence,
            max_in_flight=cfg.max_in_flight_calls,
            max_held=cfg.max_held_calls,
            max_held_bytes=cfg.max_held_bytes,
            hold_s=cfg.held_call_timeout_s,
        ),
        access=AccessChecker(ttl=access_ttl, what="training session") if access_ttl is not None else None,
        task_id=ctx.task_id,
        attempt=ctx.attempt,
        touch=touch,
    )
    running = await start_training_server(
        servicer, host=os.environ.get("OPENTINKER_BIND_HOST", "0.0.0.0"), port=cfg.port, tls=tls
    )
    host = os.environ.get("OPENTINKER_ADVERTISE_HOST") or "127.0.0.1"
    address = f"{host}:{running.port}"
    if tls is not None:
        address = f"https://{address}"
    ctx.emit_endpoint(address)
    log.info(
        "session serving",
        task_id=ctx.task_id,
        attempt=ctx.attempt,
        endpoint=address,
        next_sequence=next_sequence,
        resumed_from=session.resumed_from or None,
        idle_timeout_s=cfg.idle_timeout_s,
        api_key_check=access_ttl is not None,
    )
    try:
        while not ctx.should_stop():
            if servicer.seq.in_flight:
                touch()  # a long call is activity
            elif time.monotonic() - last[0] > cfg.idle_timeout_s:
                break
            await asyncio.sleep(POLL_S)
    finally:
        await running.stop(grace=2.0)
    log.info(
        "session stopped",
        task_id=ctx.task_id,
        reason="stop requested" if ctx.should_stop() else "idle",
        calls=servicer.calls,
        step=session.step,
    )
