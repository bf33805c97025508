"""Model host: many LoRA tasks (tenants) on one copy of a base model.
``python -m opentinker_trainer.host --model M --device D --dtype T``.

The node agent starts one host per (GPU set, base model, dtype) for shareable LoRA work
(:func:`shareable`) and hands it task attempts instead of starting a worker process for each
(:mod:`opentinker_trainer.agent`). The host loads the base model once (frozen: no gradients,
eval mode) and wraps it in one PEFT ``PeftModel``; every tenant is one task attempt with

* its own named adapter on that model (``add_adapter``; the name is ``t<task>-a<attempt>``),
  freshly initialised from the task's seed, or loaded from its ``resume_from`` / ``init_from``
  LoRA checkpoint;
* its own optimizer over that adapter's parameters only (:meth:`Tenant.parameters`);
* its own RNG streams: the global generators (torch, numpy, Python) are saved when its turn
  ends and restored when its next turn starts, so it draws exactly what it would draw alone;
* its own environment, data position, report stamp and checkpoints, written in the same PEFT
  format as a worker's (only its adapter, files at the top of ``step_<n>``) through the same
  artifact upload (:func:`opentinker_trainer.worker.prepare`).

Each tenant runs the ordinary trainer (``workloads/grpo_text.py``) in a thread of its own; the
threads take **turns** on the model (:class:`RoundRobin`): a step (a batched rollout splits it
in two, see below), a checkpoint or the adapter's creation is one turn, and for a serving tenant
(an ``inference`` task, ``workloads/serving.py``, which serves the host's base and the adapters
it loads under its :attr:`Tenant.serving_prefix`) calls of its model thread (an adapter load, a
prefill pass, a decode step of its batch) while it has work, for up to as long as the longest
last turn of a training neighbour (:meth:`RoundRobin.slice_for`: time-fair; a batched run's
time is shared among the tenants it served). Turns go round in the order tenants asked for
them (first come, first served, which with every tenant asking again right after its turn is
round-robin). Only one turn runs at a time, with only that tenant's adapter active (a serving
turn ends with the adapter layers on again and no row plan, ``AdapterRegistry.leave_turn``; a
batched rollout's passes run each row on its own tenant's adapter), so a tenant's numbers do not
depend on its neighbours: with a fixed seed its reward curve and final adapter are those of the
same task alone (tested, with three neighbours batched with it, rollouts and updates), up to
float rounding.

Rollouts are batched across tenants (:meth:`Tenant.generate`, :meth:`RoundRobin.rollout`): a
tenant's rollout gives up its turn and queues with its request; the first rollout to come up in
line takes along every rollout request then waiting, wherever it waits, and samples them all at
once, one forward pass per token with each row on its own tenant's adapter
(:func:`opentinker_trainer.rl.rollout_batch.generate_batched`: rows grouped by adapter, or PEFT's
per-row ``adapter_names``) and each tenant's draws taken from its own torch RNG stream exactly as
``generate`` alone would take them (same shapes, same order), so its tokens are those it samples
alone up to float rounding of the shared pass. The tenants taken along keep their places in the
queue and continue their steps there. It is opportunistic: nobody waits for a tenant that is not
ready to roll out. A rollout run alone is ``generate`` itself (a worker's numbers exactly), and
so is every rollout on a model whose generation config adds logits processors
(:func:`~opentinker_trainer.rl.rollout_batch.unbatchable`).

Update passes are batched the same way (:meth:`Tenant.update_pass`, :meth:`RoundRobin.update`):
each micro-batch of a tenant's update queues with its rows and its loss; the first to come up in
line runs every update pass then waiting in one forward and backward, each row on its own
tenant's adapter, and hands each tenant the gradient of its own loss on its own adapter
(:func:`opentinker_trainer.rl.update_batch.run_batched`; a pass takes up to
:data:`~opentinker_trainer.rl.update_batch.PASS_TOKENS` token positions and ``PASS_SHARE``
times the largest request's, the rest run in further passes); each tenant then clips and steps its own optimizer
in its turn. In a steady cycle of N training tenants each round is one batched rollout and one
batched update run per micro-batch.
A pass run alone is the tenant's solo pass; a batched pass that fails runs again request by
request alone, logged and counted (``RoundRobin.fallbacks``).

Isolation: an exception in a tenant ends only that tenant (``failed``, retryable unless it is a
user error); its adapter and optimizer are then freed (``delete_adapter``, garbage collection).
A crash of the whole process ends all tenants; the agent then reports each attempt failed
(retryable), and the scheduler requeues each to resume from its own newest checkpoint.

Protocol, JSON lines. Agent to host on stdin:
``{"op": "add", "assignment": PATH, "checkpoint_dir": PATH}`` (a serialized ``AssignTask``, as a
worker gets it) and ``{"op": "stop", "task_id": ..., "attempt": ...}`` (cancel, drain,
preemption, max_runtime: abandon the step in progress at its next abandon point and store the
last completed step, as a worker does, :mod:`opentinker_trainer.workloads._keep`). End of stdin: stop every tenant,
wait for them, exit. Host to agent on stdout: ``{"type": "host_ready", "pid": ...}`` once the base
model is loaded, or ``{"type": "host_failed", "error", "retryable"}`` and exit 1; every worker
report (:mod:`opentinker_trainer.worker`) with ``task_id`` and ``attempt`` added; and
``{"type": "released", "task_id", "attempt"}`` once a tenant ended and its memory is freed.
The host dies with the agent (``PR_SET_PDEATHSIG``), like a worker.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import structlog

from opentinker.node.v1 import node_pb2
from opentinker_common.glibc_malloc import tune_malloc
from opentinker_common.logs import configure_logging

from opentinker_trainer._proc import die_with_parent
from opentinker_trainer.context import UserError

__all__ = ["RoundRobin", "Tenant", "ModelHost", "shareable", "adapter_name"]

log = structlog.get_logger("opentinker.host")

#: ``(workload_type, env kind)`` of tasks a model host runs as tenants: LoRA GRPO on text, training
#: sessions (``lora_session``, :mod:`opentinker_trainer.workloads.lora_session`), and serving the
#: base model's LoRA adapters (``inference``; not ``policies_only``, which loads no
#: language model, nor ``checkpoint_task_id``, whose base is another task's full weights).
SHAREABLE: frozenset[tuple[str, str]] = frozenset(
    {("lora_finetune", "text"), ("inference", "text"), ("lora_session", "text")}
)


def shareable(assign: node_pb2.AssignTask) -> tuple[str, tuple[int, ...], str] | None:
    """The host key ``(spec.model, device indices, dtype)`` of ``assign`` when it can run as a
    tenant of a model host, else None. Shareable: a LoRA GRPO task on a text environment, a
    training session (``lora_session``) or an
    inference task serving the base model's adapters (:data:`SHAREABLE`), one rank (at most one
    device, no gang), whose base weights are ``spec.model`` (not an ``init_from`` full-weight
    checkpoint; for serving, neither ``policies_only`` nor ``checkpoint_task_id``; for a training
    session, not ``lora: false``), with a valid
    spec (an invalid one goes to a worker, which reports the error)."""
    from opentinker_common.spec import SpecError, env_kind, spec_from_proto

    try:
        spec = spec_from_proto(assign.spec)
        kind = (spec.workload_type, env_kind(spec.env))
    except SpecError:
        return None
    hp = spec.hyperparameters
    if (
        kind not in SHAREABLE
        or getattr(hp, "policies_only", False)
        or getattr(hp, "checkpoint_task_id", "")
        or getattr(hp, "lora", True) is False  # a full-weight session: weights of its own
        or len(assign.device_indices) > 1
        or (assign.HasField("gang") and assign.gang.world_size > 1)
        or assign.init_checkpoint.format == "hf_full"
    ):
        return None
    return (spec.model, tuple(assign.device_indices), str(getattr(spec.hyperparameters, "dtype", "auto")))


def adapter_name(task_id: str, attempt: int) -> str:
    """The adapter name of a tenant: ``t<task id>-a<attempt>`` with characters PEFT module
    names cannot hold (``.``) replaced."""
    return f"t{task_id}-a{attempt}".replace(".", "_")


class _Ask:
    """One wait in a :class:`RoundRobin` queue: ``who`` asks for the model, for a run of
    ``kind`` (``rollout``, ``update``) with ``request`` (None: an ordinary turn); a request taken
    along by another's turn is ``taken``, and ``done`` with its ``outcome`` once run."""

    __slots__ = ("who", "kind", "request", "taken", "done", "outcome")

    def __init__(self, who: object, request: object = None, kind: str = "") -> None:
        self.who, self.request, self.kind = who, request, kind
        self.taken = self.done = False
        self.outcome: object = None


class RoundRobin:
    """Turns on one model, one at a time, in the order they were asked for; rollouts of the
    tenants waiting are run together (:meth:`rollout`), and so are their update passes
    (:meth:`update`).

    A tenant that asks again right after its turn queues behind every tenant already waiting,
    so tenants that keep asking take turns in a fixed cycle (round-robin by steps).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: collections.deque[_Ask] = collections.deque()
        self._holder: object | None = None
        self._since = 0.0  # when the holder's current hold began (perf_counter)
        self._held: dict[object, float] = {}  # who -> seconds held so far in its current turn
        self._last_s: dict[object, float] = {}  # who -> seconds its last turn lasted
        self._sliced: set[object] = set()  # who asked for a slice (holds turns over several calls)
        #: How many turns ran, for tests and logs.
        self.turns = 0
        #: Batched runs by kind (``rollout``, ``update``) and the requests they took, for tests and logs.
        self.runs: collections.Counter[str] = collections.Counter()
        self.requests: collections.Counter[str] = collections.Counter()
        #: Batched passes by kind that failed and ran again request by request alone.
        self.fallbacks: collections.Counter[str] = collections.Counter()

    def slice_for(self, who: object) -> float:
        """Seconds a turn of ``who`` may last to take as long as its neighbours' do: the longest
        last turn of any other (0.0 alone). A serving tenant holds its turn over several decode
        steps up to this (``ModelRuntime``'s ``turn_slice``), so it gets the model about as long
        per cycle as each training tenant does (time-fair), not one decode step per training step.
        Turns of tenants that ask for slices themselves are not counted: two serving tenants
        would otherwise lengthen each other's slices without end. A turn's length is the time
        its tenant held the model, with a shared run, a rollout (:meth:`rollout`) or an update
        pass (:meth:`update`), split evenly among the tenants it served."""
        with self._cond:
            self._sliced.add(who)
            return max((s for w, s in self._last_s.items() if w not in self._sliced), default=0.0)

    def forget(self, who: object) -> None:
        """``who`` left: its turn length no longer sets anyone's slice."""
        with self._cond:
            self._last_s.pop(who, None)
            self._sliced.discard(who)

    # --- under self._cond ------------------------------------------------------------------
    def _take(self, ask: _Ask) -> None:
        """Wait until ``ask`` is first in line and the model is free; hold it."""
        while self._holder is not None or self._queue[0] is not ask:
            self._cond.wait()
        self._queue.popleft()
        self._holder = ask.who
        self._since = time.perf_counter()

    def _give(self, who: object) -> None:
        """``who`` lets go of the model (its hold counted into its turn's length)."""
        self._held[who] = self._held.get(who, 0.0) + time.perf_counter() - self._since
        self._holder = None
        self._cond.notify_all()

    @contextlib.contextmanager
    def turn(self, who: object) -> Iterator[None]:
        """Wait for ``who``'s turn, hold it for the ``with`` block."""
        ask = _Ask(who)
        with self._cond:
            self._queue.append(ask)
            self._take(ask)
            self._held[who] = 0.0
            self.turns += 1
        try:
            yield
        finally:
            with self._cond:
                self._give(who)
                self._last_s[who] = self._held.pop(who, 0.0)

    def rollout(self, who: object, request: object, run: Callable[[list], list]) -> object:
        """Inside ``who``'s turn: run ``request`` together with the rollouts of every tenant
        waiting for one, and return ``who``'s outcome, ``who`` holding its turn again.

        ``who`` lets go of the model and queues at the back with its request, as if asking for a
        new turn (whoever waited goes first, and may ask for a rollout in its turn too). When a
        waiting rollout comes first in line, its tenant takes the turn and runs
        ``run(requests)`` (a list of outcomes, one per request, in order) on its own request and
        every other rollout request then in the queue, wherever it waits; those tenants keep
        their places in the queue and, when their turn comes, continue with their outcome (no
        second run). So a rollout never waits for a tenant that is not ready to roll out, every
        wait ends (each queue entry is served in order), and in a steady cycle of N tenants the
        N rollouts run as one. A rollout taken along runs earlier than its place in line, never
        later; the tenants waiting in between for ordinary turns (a serving tenant, a
        checkpoint) wait that much longer once. If ``run`` raises, every request of that run gets
        the exception as its outcome.
        """
        return self._together(who, "rollout", request, run)

    def update(self, who: object, request: object, run: Callable[[list], list]) -> object:
        """:meth:`rollout` for an update pass: ``request`` runs together with the update
        requests then waiting (never with rollouts), so in a steady cycle of N tenants the N
        updates' passes run as one too."""
        return self._together(who, "update", request, run)

    def _together(self, who: object, kind: str, request: object, run: Callable[[list], list]) -> object:
        with self._cond:
            if self._holder is not who:
                raise RuntimeError(f"RoundRobin.{kind} is called inside the caller's own turn")
            self._give(who)
            ask = _Ask(who, request, kind)
            self._queue.append(ask)
            self._take(ask)
            if ask.done:
                return ask.outcome
            batch = [ask] + [a for a in self._queue if a.kind == kind and not a.taken]
            for a in batch:
                a.taken = True
        started = time.perf_counter()
        try:
            outcomes = list(run([a.request for a in batch]))
            if len(outcomes) != len(batch):
                raise RuntimeError(f"a {kind} run returned {len(outcomes)} outcomes for {len(batch)} requests")
        except Exception as exc:  # noqa: BLE001 - handed to every tenant of the run, never lost
            outcomes = [exc] * len(batch)
        with self._cond:
            spent = time.perf_counter() - started
            self._since += spent  # the run is everyone's: split below, not the runner's alone
            for a, outcome in zip(batch, outcomes):
                a.outcome, a.done = outcome, True
                self._held[a.who] = self._held.get(a.who, 0.0) + spent / len(batch)
            self.runs[kind] += 1
            self.requests[kind] += len(batch)
            self._cond.notify_all()
        return ask.outcome


class Tenant:
    """One task attempt on a :class:`ModelHost`: its adapter, RNG streams and turn.

    The trainer calls :meth:`attach` (inside a turn) to get the shared model with this tenant's
    adapter active, and :meth:`parameters` for its optimizer; every later use of the model runs
    inside :meth:`turn` (``WorkerContext.turn``).
    """

    def __init__(self, host: "ModelHost", task_id: str, attempt: int) -> None:
        self.host = host
        self.task_id = task_id
        self.attempt = attempt
        self.name = adapter_name(task_id, attempt)
        #: A serving tenant's PEFT adapter names start with this (``s<task>-a<attempt>-``): never
        #: a training tenant's ``t...`` name nor another serving tenant's.
        self.serving_prefix = "s" + self.name[1:] + "-"
        self._rng: dict[str, Any] | None = None
        self.attached = False
        self.ctx = None  # its WorkerContext, set by the host
        self.stop_early = False  # a stop that came before its context existed

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """This tenant's span on the model: its adapter active and its RNG streams in place."""
        from opentinker_trainer.workloads import _rng

        with self.host.turns.turn(self):
            if self._rng is not None:
                _rng.restore_rng_state(self._rng)
            if self.attached:
                self.host.model.set_adapter(self.name)
            try:
                yield
            finally:
                self._rng = _rng.rng_state()

    def generate(
        self,
        model,
        prompt_ids,
        prompt_mask,
        *,
        max_new_tokens: int,
        stop_token_ids,
        pad_token_id: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        group_size: int = 1,
        seed: int | None = None,
        synced: bool = False,
    ):
        """:func:`opentinker_trainer.rl.rollout.generate` for this tenant (the same arguments and
        :class:`~opentinker_trainer.rl.rollout.Rollout`), called inside its turn; batched with
        the rollouts of the tenants waiting (:meth:`RoundRobin.rollout`,
        :func:`opentinker_trainer.rl.rollout_batch.generate_batched`) unless the model is in
        train mode (a batch samples in eval mode, as the trainers do) or its generation config
        adds processors a batch does not apply
        (:func:`~opentinker_trainer.rl.rollout_batch.unbatchable`). Its draws come from
        its own torch RNG stream exactly as ``generate``'s would, which continues from where
        they end; its numpy and Python streams, the model's mode and its active adapter are as
        ``generate`` leaves them.

        Raises:
            Exception: whatever its own rollout raised (another tenant's failure is not raised here).
        """
        from opentinker_trainer.context import abandon_point
        from opentinker_trainer.rl import rollout_batch
        from opentinker_trainer.rl.rollout import generate

        kw = dict(
            max_new_tokens=max_new_tokens,
            stop_token_ids=stop_token_ids,
            pad_token_id=pad_token_id,
            temperature=temperature,
            top_p=top_p,
            group_size=group_size,
        )
        host = self.host
        if seed is not None or synced or model.training or host.unbatchable is not None:
            return generate(model, prompt_ids, prompt_mask, seed=seed, synced=synced, **kw)
        device = next(model.parameters()).device
        request = rollout_batch.RolloutRequest(
            adapter=self.name,
            prompt_ids=prompt_ids.to(device),
            prompt_mask=prompt_mask.to(device),
            rng_state=rollout_batch.rng_state(device),
            **kw,
        )
        abandon_point()  # a stopped tenant leaves its step before its rollout queues, or once it is back
        outcome = self._shared_run(host.turns.rollout, request, host.run_rollouts)
        rollout_batch.set_rng_state(outcome.rng_state, device)
        return outcome.rollout

    def update_pass(self, rollout, params: list, loss_of, temperature: float, group_size: int):
        """One micro-batch of this tenant's update (``grpo_update``'s ``chunk_pass``), called
        inside its turn: batched with the update passes of the tenants waiting
        (:meth:`RoundRobin.update`, :func:`opentinker_trainer.rl.update_batch.run_batched`).
        Adds the gradient of ``loss_of`` on ``params`` (this tenant's adapter's) to their
        ``.grad`` and returns the rows' token log-probs, detached; its RNG streams, the model's
        mode and its active adapter are as before.

        Raises:
            Exception: whatever its own pass raised (another tenant's failure is not raised here).
        """
        from opentinker_trainer.rl import update_batch

        host = self.host
        request = update_batch.UpdateRequest(
            adapter=self.name,
            params=params,
            rollout=rollout,
            loss_of=loss_of,
            temperature=temperature,
            group_size=group_size,
        )
        outcome = self._shared_run(host.turns.update, request, host.run_updates)
        update_batch.add_grads(params, outcome.grads)
        return outcome.logp

    def _shared_run(self, join, request, run):
        """Queue ``request`` with ``join`` (:meth:`RoundRobin.rollout` or :meth:`RoundRobin.update`)
        for a run of ``run`` that may take along other tenants' requests, and return this
        tenant's outcome. Its RNG streams, the model's mode and its active adapter are restored
        after the run; a stopped tenant leaves at the abandon point right after.

        Raises:
            Exception: whatever its own request raised.
        """
        from opentinker_trainer.context import abandon_point
        from opentinker_trainer.workloads import _rng

        model = self.host.model
        training = model.training
        self._rng = _rng.rng_state()  # its streams while others hold the model
        outcome = join(self, request, run)
        _rng.restore_rng_state(self._rng)
        model.set_adapter(self.name)
        model.train(training)
        abandon_point()
        if isinstance(outcome, BaseException):
            raise outcome
        if outcome.error is not None:
            raise outcome.error
        return outcome

    def turn_slice(self) -> float:
        """Seconds this tenant's turn may last (:meth:`RoundRobin.slice_for`)."""
        return self.host.turns.slice_for(self)

    def attach(self, cfg) -> tuple[Any, Any]:
        """``(tokenizer, model)``: the host's model with this tenant's adapter added and active.

        A fresh adapter is initialised right after ``torch.manual_seed(cfg.seed)``, as a worker
        does (``workloads/_lm.py::load_for_training``), so it starts from the same weights; a
        resumed attempt loads its ``resume_from`` adapter, else an ``init_from`` LoRA adapter.
        Call it inside :meth:`turn`.

        Raises:
            UserError: the target modules are not in the model, or a checkpoint is not a
                complete LoRA adapter of it.
        """
        import torch

        from opentinker_trainer.workloads import _lm

        ctx = self.ctx
        torch.manual_seed(cfg.seed)
        source, what = None, ""
        if ctx.resume_from is not None:
            source, what = ctx.resume_from, "resume_from: checkpoint"
        elif ctx.init_checkpoint is not None and ctx.init_format == _lm.FORMAT_LORA:
            source, what = Path(ctx.init_checkpoint), _lm.INIT_WHAT
        self.host.add_adapter(self.name, cfg, source, what)
        self.attached = True
        self.host.model.set_adapter(self.name)
        return self.host.tokenizer, self.host.model

    def parameters(self) -> list:
        """This tenant's adapter's parameters (and no other tenant's)."""
        marker = f".{self.name}."
        return [p for n, p in self.host.model.named_parameters() if marker in n]

    def detach(self) -> None:
        """Free this tenant's adapter (its optimizer goes with its trainer)."""
        if self.attached:
            with self.host.turns.turn(self):
                self.host.delete_adapter(self.name)
            self.attached = False


class ModelHost:
    """One frozen base model and its tenants (see the module docstring).

    Raises:
        UserError: the base model cannot be loaded (from :func:`opentinker_trainer.workloads._lm.load_model`).
    """

    def __init__(self, model: str, device: str, dtype: str, out) -> None:
        import torch

        from opentinker_trainer.rl.rollout_batch import unbatchable
        from opentinker_trainer.workloads import _lm

        self.device = device
        self.out = out
        self.lock = threading.Lock()  # one lock for every line on ``out``
        self.turns = RoundRobin()
        torch_device = torch.device(device)
        self.tokenizer, base = _lm.load_model(model, torch_device, _lm.resolve_dtype(dtype, torch_device))
        base.requires_grad_(False)
        base.eval()
        self.base = base
        #: Why rollouts cannot be batched on this model (:func:`~.rl.rollout_batch.unbatchable`), or None.
        self.unbatchable = unbatchable(base)
        if self.unbatchable is not None:
            log.info("rollouts are not batched across tenants on this model", reason=self.unbatchable)
        self.model = None  # the PeftModel, made with the first adapter
        self.tenants: dict[tuple[str, int], Tenant] = {}
        self.threads: dict[tuple[str, int], threading.Thread] = {}

    # --- adapters --------------------------------------------------------------------------
    def add_adapter(self, name: str, cfg, source: Path | None, what: str) -> None:
        """Add adapter ``name``: fresh from ``cfg`` (rank, alpha, dropout, targets), or loaded
        from the PEFT folder ``source`` (checked complete, as ``_lm.load_adapter`` does)."""
        from peft import LoraConfig, PeftModel, get_peft_model

        from opentinker_trainer.lora_keys import unloaded_keys, unloaded_message
        from opentinker_trainer.workloads import _lm

        if source is None:
            config = LoraConfig(
                r=cfg.lora_rank,
                lora_alpha=cfg.lora_alpha,
                lora_dropout=cfg.lora_dropout,
                target_modules=list(cfg.target_modules),
                task_type="CAUSAL_LM",
            )
            try:
                if self.model is None:
                    with _lm.peft_wrapping():
                        self.model = get_peft_model(self.base, config, adapter_name=name)
                else:
                    self.model.add_adapter(name, config)
            except ValueError as exc:
                raise UserError(f"hyperparameters.target_modules {list(cfg.target_modules)}: {exc}") from exc
            return
        if self.model is None:
            with _lm.peft_wrapping():
                self.model = PeftModel.from_pretrained(self.base, str(source), adapter_name=name, is_trainable=True)
        else:
            if getattr(self.model, "active_adapter", None) not in self.model.peft_config:
                # Every adapter was deleted (the last tenant ended, e.g. preempted): PEFT keeps the
                # deleted name active and load_adapter then fails (KeyError, peft 0.21). Add the
                # adapter from its config first, the RNG untouched (its weights are loaded next).
                import torch

                with torch.random.fork_rng():
                    self.model.add_adapter(name, LoraConfig.from_pretrained(str(source)))
                self.model.set_adapter(name)  # a live name active again; its parameters trainable
            self.model.load_adapter(str(source), adapter_name=name, is_trainable=True)
        try:
            missing, not_loaded = unloaded_keys(self.model, name, source)
        except FileNotFoundError as exc:
            self.delete_adapter(name)
            raise UserError(f"{what} {source} is not a PEFT LoRA adapter: {exc}") from None
        if missing or not_loaded:
            self.delete_adapter(name)
            raise UserError(f"{what} {source}: {unloaded_message(missing, not_loaded)}")

    def delete_adapter(self, name: str) -> None:
        if self.model is not None and name in self.model.peft_config:
            self.model.delete_adapter(name)
        gc.collect()

    def live_tenant(self, task_id: str) -> Tenant | None:
        """The training tenant of ``task_id`` whose adapter is on the model and has taken a step
        (its newest attempt), else None. Read its ``ctx.steps_done`` and adapter inside a turn."""
        found = [
            t
            for (tid, _), t in list(self.tenants.items())
            if tid == task_id and t.attached and t.ctx is not None and t.ctx.steps_done > 0
        ]
        return max(found, key=lambda t: t.attempt) if found else None

    def run_rollouts(self, requests: list) -> list:
        """Run tenants' rollout requests together on the model (in the turn of one of them):
        :func:`opentinker_trainer.rl.rollout_batch.generate_batched`, one outcome per request."""
        from opentinker_trainer.rl.rollout_batch import generate_batched

        return generate_batched(self.model, requests)

    def run_updates(self, requests: list) -> list:
        """Run tenants' update passes together on the model (in the turn of one of them):
        :func:`opentinker_trainer.rl.update_batch.run_batched`, one outcome per request; each
        batched pass that fails and runs again alone counts in ``turns.fallbacks["update"]``."""
        from opentinker_trainer.rl.update_batch import run_batched

        return run_batched(self.model, requests, fallback=lambda exc: self.turns.fallbacks.update(["update"]))

    # --- tenants ---------------------------------------------------------------------------
    def emit(self, kind: str, **payload: Any) -> None:
        line = json.dumps({"type": kind, "time": time.time(), **payload}, allow_nan=False)
        with self.lock:
            self.out.write(line + "\n")
            self.out.flush()

    def add(self, assignment: Path, checkpoint_dir: Path) -> None:
        """Start a tenant for the ``AssignTask`` in file ``assignment`` (a duplicate is ignored)."""
        assign = node_pb2.AssignTask.FromString(Path(assignment).read_bytes())
        key = (assign.task_id, assign.attempt)
        if key in self.tenants:
            return
        tenant = Tenant(self, assign.task_id, assign.attempt)
        self.tenants[key] = tenant
        thread = threading.Thread(
            target=self._run_tenant, args=(tenant, assign, Path(checkpoint_dir)), name=tenant.name, daemon=True
        )
        self.threads[key] = thread
        thread.start()

    def stop(self, task_id: str, attempt: int) -> None:
        """Ask a tenant to stop: it abandons its step in progress at the step's next abandon point
        (:func:`opentinker_trainer.context.abandon_point`) and stores its last completed step."""
        tenant = self.tenants.get((task_id, int(attempt)))
        if tenant is not None and tenant.ctx is not None:
            tenant.ctx.request_stop()
        elif tenant is not None:
            tenant.stop_early = True

    def stop_all(self) -> None:
        for task_id, attempt in list(self.tenants):
            self.stop(task_id, attempt)

    def _run_tenant(self, tenant: Tenant, assign: node_pb2.AssignTask, checkpoint_dir: Path) -> None:
        from opentinker_trainer.worker import execute, prepare

        structlog.contextvars.bind_contextvars(task_id=assign.task_id, attempt=assign.attempt)
        bound = log.bind(task_id=assign.task_id, attempt=assign.attempt, adapter=tenant.name)
        stamp = {"task_id": assign.task_id, "attempt": assign.attempt}
        try:
            ctx = prepare(
                assign, checkpoint_dir, self.device, self.out, bound, stamp=stamp, tenant=tenant, _lock=self.lock
            )
            if ctx is not None:
                tenant.ctx = ctx
                if tenant.stop_early:
                    ctx.request_stop()
                bound.info("tenant joined", tenants=len(self.tenants))
                execute(ctx, assign, self.device, bound)
        except Exception as exc:  # noqa: BLE001 - never let one tenant take the host down
            bound.error("tenant failed outside its trainer", error=repr(exc))
            self.emit("failed", error=f"{type(exc).__name__}: {exc}", retryable=True, **stamp)
        finally:
            tenant.ctx = None
            self.turns.forget(tenant)
            try:
                tenant.detach()
            finally:
                del self.tenants[(assign.task_id, assign.attempt)]
                self.threads.pop((assign.task_id, assign.attempt), None)
                gc.collect()
                bound.info("tenant released", tenants=len(self.tenants))
                self.emit("released", **stamp)

    def join(self) -> None:
        for thread in list(self.threads.values()):
            thread.join()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="opentinker-model-host")
    parser.add_argument("--model", required=True, help="base model: a folder or hub id (spec.model)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16 (hyperparameters.dtype)")
    args = parser.parse_args(argv)
    os.umask(0o077)
    tune_malloc(max_arenas=2)  # tenants take turns: shared arenas, not one per thread keeping its activations
    configure_logging()
    structlog.contextvars.bind_contextvars(node_id=os.environ.get("OPENTINKER_NODE_ID", ""), host_pid=os.getpid())
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    started = time.perf_counter()
    try:
        host = ModelHost(args.model, args.device, args.dtype, out)
    except UserError as exc:
        json.dump({"type": "host_failed", "error": str(exc), "retryable": False}, out)
        out.write("\n")
        out.flush()
        return 1
    except Exception as exc:  # noqa: BLE001 - reported to the agent, which fails the attempts waiting
        json.dump({"type": "host_failed", "error": f"{type(exc).__name__}: {exc}", "retryable": True}, out)
        out.write("\n")
        out.flush()
        return 1
    log.info("model host ready", model=args.model, device=args.device, load_s=round(time.perf_counter() - started, 2))
    host.emit("host_ready", pid=os.getpid(), model=args.model)
    signal.signal(signal.SIGTERM, lambda *_: host.stop_all())
    for line in sys.stdin:
        try:
            msg = json.loads(line)
            op = msg["op"]
            if op == "add":
                host.add(Path(msg["assignment"]), Path(msg["checkpoint_dir"]))
            elif op == "stop":
                host.stop(str(msg["task_id"]), int(msg["attempt"]))
            else:
                log.warning("unknown op from the agent", op=op)
        except (ValueError, KeyError, TypeError, OSError) as exc:
            log.warning("unreadable line from the agent", error=repr(exc), line=line[:200])
    host.stop_all()
    host.join()
    log.info("model host exiting: its agent closed the channel")
    return 0


if __name__ == "__main__":
    die_with_parent()
    sys.exit(main())
