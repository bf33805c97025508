"""``inference``: serve the task's base model plus LoRA adapters over ``InferenceService``.

Loads the model once, starts a grpc.aio server (with health and reflection) on
``hyperparameters.port`` (0 = any free port) on all interfaces, reports ``host:port`` upward
(``ctx.emit_endpoint``; the scheduler shows it as ``Task.endpoint``) and serves until the task is
cancelled (SIGTERM -> ``ctx.should_stop()``; in-flight requests get 2 s to finish) or ``ttl_s``
runs out (the task ends SUCCEEDED).

The advertised host is ``OPENTINKER_ADVERTISE_HOST`` (the node agent sets it from its
``--advertise-host``). Adapters are resolved through the scheduler at
``OPENTINKER_SCHEDULER_URL`` (set by the agent); their checkpoints are fetched from the artifact
store (the scheduler's ``local`` store or the ``s3`` bucket) through the node-local cache, so no
filesystem is shared with the nodes that trained them. With ``hyperparameters.checkpoint_task_id``
the base model served is that finished task's full-weight (``hf_full``) checkpoint, fetched the
same way and served under the task's id (``resolve.SchedulerResolver.full_weights``).

Security (docs/inference.md, "Security"): with ``OPENTINKER_SCHEDULER_URL`` set, every
InferenceService call is checked against the scheduler with the caller's endpoint token
(:class:`~opentinker_trainer.inference.access.AccessChecker`; decisions cached for
``OPENTINKER_INFERENCE_AUTH_TTL_S`` seconds, default 10). With ``OPENTINKER_SERVE_TLS_CERT`` /
``OPENTINKER_SERVE_TLS_KEY`` (the trainer's ``--serve-tls-cert`` / ``--serve-tls-key``) the port
speaks TLS and the reported endpoint is ``https://host:port``.

On a model host (:mod:`opentinker_trainer.host`; ``ctx.tenant`` set) the task is a serving
tenant: it serves the host's base model, loaded once for all its tenants, instead of loading its
own; its adapters go onto the host's ``PeftModel`` under names of its own
(``Tenant.serving_prefix``) and leave it when the task ends; every model-thread call of its
runtime (an adapter load, a prefill pass, a decode step) runs in its turn (``ctx.turn``), taken
in round-robin order with the training tenants' steps. A request naming a training tenant's task
is served that tenant's live adapter: copied in the serving turn, so between two of its steps,
and named by the step it has reached (:func:`_live_copy`).

With ``hyperparameters.openai_port`` >= 0 an OpenAI-compatible HTTP endpoint
(:mod:`opentinker_trainer.inference.openai_http`) serves the same runtime on that port, with the
same API-key checks and TLS (``https://``); its base URL ``http(s)://host:port/v1``, with the
port it got when ``openai_port`` is 0, is reported with the endpoint (``Task.openai_endpoint``).
"""

from __future__ import annotations

import asyncio
import os
import time

import torch

from opentinker_trainer.context import UserError, WorkerContext
from opentinker_trainer.inference.access import DEFAULT_TTL_S, TTL_ENV, AccessChecker
from opentinker_trainer.worker_artifacts import fetch_checkpoint
from opentinker_trainer.inference.policies import PolicyRegistry
from opentinker_trainer.inference.resolve import SchedulerResolver, split_adapter_name
from opentinker_trainer.inference.runtime import ModelRuntime, RuntimeConfig, SharedModel
from opentinker_trainer.inference.server import start_inference_server
from opentinker_trainer.inference.serve_tls import server_tls_from_env
from opentinker_trainer.workloads import _lm

log = _lm.get_logger("opentinker.trainer.inference")

#: Seconds between checks for a stop request or the end of the TTL.
POLL_S = 0.2


def auth_ttl(env=None) -> float:
    """Seconds an access decision is cached: ``$OPENTINKER_INFERENCE_AUTH_TTL_S``, default 10.

    Raises:
        ValueError: not a number > 0 (naming the variable).
    """
    text = (os.environ if env is None else env).get(TTL_ENV, "")
    if not text:
        return DEFAULT_TTL_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (value > 0 and value < float("inf")):
        raise ValueError(f"{TTL_ENV}: expected seconds > 0, got {text!r}")
    return value


def run(ctx: WorkerContext) -> None:
    cfg = ctx.spec.hyperparameters
    tls = server_tls_from_env()  # checked at trainer start too; a bad file fails before the model loads
    ttl = auth_ttl()
    if getattr(cfg, "policies_only", False):
        _run_policies_only(ctx, cfg, tls=tls, ttl=ttl)
        return
    device = torch.device(ctx.device)
    dtype = _lm.resolve_dtype(cfg.dtype, device)
    scheduler = os.environ.get("OPENTINKER_SCHEDULER_URL")
    # Served under the full-weight task's id, when it is one: adapters of the base model are refused.
    served = cfg.checkpoint_task_id or ctx.spec.model
    # Adapters, policies and full weights come from the artifact store, through the node-local cache.
    resolver = SchedulerResolver(scheduler, served, fetch=_fetcher(ctx), env=ctx.scheduler_env()) if scheduler else None
    tenant = getattr(ctx, "tenant", None)  # a model host's serving tenant: its base is loaded already
    shared: SharedModel | None = None
    try:
        if tenant is not None:
            tokenizer, model = tenant.host.tokenizer, tenant.host.base
            shared = SharedModel(
                host=tenant.host,
                adapter_prefix=tenant.serving_prefix,
                turn=ctx.turn,
                turn_slice=tenant.turn_slice,
                live=lambda name: _live_copy(tenant.host, runtime, name),
            )
            log.info(
                "serving from the model host",
                task_id=ctx.task_id,
                model=ctx.spec.model,
                adapter_prefix=tenant.serving_prefix,
            )
        else:
            tokenizer, model = _load_served_model(ctx, cfg, resolver, device, dtype)
    except BaseException:
        if resolver is not None:
            resolver.close()
        raise
    # On a host the runtime is built in a turn: it puts the shared model in eval mode.
    with ctx.turn():
        runtime = ModelRuntime(
            model_name=served,
            tokenizer=tokenizer,
            model=model,
            stop_token_ids=_lm.stop_token_ids(tokenizer, model),
            resolve=resolver,
            config=RuntimeConfig(
                max_resident_adapters=cfg.max_resident_adapters,
                max_concurrent=cfg.max_concurrent_requests,
                max_batch_sequences=cfg.max_batch_sequences,
                max_batch_tokens=cfg.max_batch_tokens,
                max_queued=cfg.max_queued_requests,
                packed_weights=cfg.packed_weights,
            ),
            shared=shared,
        )
    policies = _policies(resolver, cfg)
    try:
        asyncio.run(_serve(ctx, runtime, cfg, tls=tls, access_ttl=ttl if scheduler else None, policies=policies))
    finally:
        runtime.close()
        if tenant is not None:
            runtime.unload_adapters()  # its adapters leave the host's model with it
        if resolver is not None:
            resolver.close()


def _live_copy(host, runtime: ModelRuntime, name: str) -> str | None:
    """On a model host, in the serving tenant's turn: for adapter ``name`` naming a training
    tenant of this host (``<task id>``, no step), its adapter as it is now, between two of its
    steps, copied and pinned as ``<task id>@<step>`` (``step``: its last step, whose update is
    in the model); None when no tenant of the host trains that task (or it has taken no step
    yet), or its adapter cannot be copied: the request then goes by checkpoints."""
    task_id, step = split_adapter_name(name)
    tenant = None if step else host.live_tenant(task_id)
    ctx = tenant.ctx if tenant is not None else None
    if ctx is None or ctx.steps_done < 1:
        return None
    version = f"{task_id}@{ctx.steps_done}"
    return version if runtime.registry.acquire_copy(version, tenant.name) else None


def _load_served_model(ctx: WorkerContext, cfg, resolver: SchedulerResolver | None, device, dtype):
    """``(tokenizer, model)``: ``spec.model``, or with ``checkpoint_task_id`` that task's full-weight
    checkpoint at ``checkpoint_step`` (fetched hash-checked through the node-local cache; the
    tokenizer saved with it, else ``spec.model``'s).

    Raises:
        UserError: the model cannot be loaded; CheckpointNotFound / CheckpointRefused (both
            UserErrors) for a checkpoint that is not there or not full weights; also without a
            scheduler to resolve the checkpoint through.
    """
    if not cfg.checkpoint_task_id:
        log.info("loading model", task_id=ctx.task_id, model=ctx.spec.model, device=str(device), dtype=str(dtype))
        with ctx.loading_model(ctx.spec.model):
            return _lm.load_model(ctx.spec.model, device, dtype)
    if resolver is None:
        raise UserError(
            f"hyperparameters.checkpoint_task_id {cfg.checkpoint_task_id!r}: serving a task's checkpoint needs "
            "the scheduler (OPENTINKER_SCHEDULER_URL, set by the node agent)"
        )
    folder, ckpt = resolver.full_weights(cfg.checkpoint_task_id, cfg.checkpoint_step)
    own_tokenizer = (folder / "tokenizer_config.json").is_file()
    log.info(
        "loading model",
        task_id=ctx.task_id,
        model=str(folder),
        checkpoint_task_id=cfg.checkpoint_task_id,
        checkpoint_step=int(ckpt.step),
        tokenizer=str(folder) if own_tokenizer else ctx.spec.model,
        device=str(device),
        dtype=str(dtype),
    )
    with ctx.loading_model(f"task {cfg.checkpoint_task_id} step {ckpt.step}"):
        return _lm.load_model(
            str(folder), device, dtype, tokenizer_from=None if own_tokenizer or not ctx.spec.model else ctx.spec.model
        )


def _fetcher(ctx: WorkerContext):
    """``Checkpoint -> folder`` through the artifact store and the node-local cache (None without a store)."""
    if ctx.publisher is None:
        return None
    store, cache = ctx.publisher.store, ctx.publisher.cache
    return lambda ck: fetch_checkpoint(store, cache, ck, fallback=False)[0]


def _policies(resolver: SchedulerResolver | None, cfg) -> PolicyRegistry | None:
    """The PPO policies ``Act`` serves, resolved through the scheduler (None without one)."""
    if resolver is None:
        return None
    return PolicyRegistry(
        resolver.policy, max_resident=cfg.max_resident_adapters, max_concurrent=cfg.max_concurrent_requests
    )


def _run_policies_only(ctx: WorkerContext, cfg, *, tls, ttl: float) -> None:
    """``policies_only``: no language model; serve ``Act`` for PPO policies until stopped or the TTL."""
    scheduler = os.environ.get("OPENTINKER_SCHEDULER_URL")
    resolver = (
        SchedulerResolver(scheduler, ctx.spec.model, fetch=_fetcher(ctx), env=ctx.scheduler_env())
        if scheduler
        else None
    )
    log.info("serving policies only", task_id=ctx.task_id, model=ctx.spec.model or None)
    try:
        asyncio.run(
            _serve(ctx, None, cfg, tls=tls, access_ttl=ttl if scheduler else None, policies=_policies(resolver, cfg))
        )
    finally:
        if resolver is not None:
            resolver.close()


async def _serve(
    ctx: WorkerContext,
    runtime: ModelRuntime | None,
    cfg,
    *,
    tls=None,
    access_ttl: float | None = None,
    policies: PolicyRegistry | None = None,
) -> None:
    # The checker asks the scheduler with the caller's key over the node's TLS settings.
    access = AccessChecker(ttl=access_ttl) if access_ttl is not None else None
    server = await start_inference_server(
        runtime,
        host=os.environ.get("OPENTINKER_BIND_HOST", "0.0.0.0"),
        port=cfg.port,
        tls=tls,
        access=access,
        task_id=ctx.task_id,
        policies=policies,
    )
    openai = None
    if cfg.openai_port >= 0:
        from opentinker_trainer.inference.openai_http import start_openai_server

        try:
            openai = await start_openai_server(
                runtime,
                host=os.environ.get("OPENTINKER_BIND_HOST", "0.0.0.0"),
                port=cfg.openai_port,
                tls=tls,
                access=access,
                task_id=ctx.task_id,
            )
        except BaseException:
            await server.stop(grace=0)
            raise
    host = os.environ.get("OPENTINKER_ADVERTISE_HOST") or "127.0.0.1"
    address = f"{host}:{server.port}"
    if tls is not None:
        address = f"https://{address}"  # tells clients to dial with TLS (InferenceClient does)
    openai_base_url = f"{openai.scheme}://{host}:{openai.port}/v1" if openai is not None else ""
    ctx.emit_endpoint(address, openai_base_url)
    log.info(
        "serving",
        task_id=ctx.task_id,
        endpoint=address,
        ttl_s=cfg.ttl_s,
        max_resident_adapters=cfg.max_resident_adapters,
        tls=tls is not None,
        api_key_check=access is not None,
        auth_cache_ttl_s=access_ttl,
        openai_base_url=openai_base_url or None,
    )
    deadline = time.monotonic() + cfg.ttl_s
    try:
        while not ctx.should_stop() and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
    finally:
        if openai is not None:
            await openai.stop()
        await server.stop(grace=2.0)
    log.info(
        "stopped serving",
        task_id=ctx.task_id,
        reason="stop requested" if ctx.should_stop() else "ttl",
        steps=runtime.steps if runtime is not None else 0,
    )
