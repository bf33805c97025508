"""The served model: one base model, its adapters, one engine task, continuous batching.

One asyncio task (the engine) owns the model; requests only enqueue and read their events. Every
forward pass and every adapter load runs on a single model thread. Each engine iteration:

1. drops the rows of requests that finished or were cancelled (a client that went away loses
   its row before the next forward pass; its adapter pin is released after that);
2. admits queued requests **first in, first out** while they fit the bounds:
   ``max_concurrent`` requests, ``max_batch_sequences`` rows (``n`` per request) and
   ``max_batch_tokens`` reserved key/value tokens (``n * (prompt + max_tokens)`` per request);
   at most ``max_prefill_tokens`` prompt tokens are prefilled per step (always at least one
   request), so a burst of long prompts does not stall the running streams for long;
3. **prefill first**: the admitted prompts run in one left-padded pass on their own, and their
   first tokens are handed out right away; the new rows join the batch;
4. runs **one decode step of every running row in one forward pass** (:class:`~.batch.DecodeBatch`;
   rows of different adapters together, each adapter's LoRA over its own rows: :mod:`~.lora_rows`),
   samples each request with its own settings and generator, and hands every request its
   tokens; stop strings are checked right away, so a stopped sample ends before the next step.
   While the batch has at most :data:`MAX_DRAFTING_ROWS` rows, a greedy request's step also
   checks a prompt-lookup draft and may yield several tokens, exactly greedy decoding's
   (:mod:`~.prompt_lookup`).
   The model thread runs such steps **back to back** and sends each step's tokens to the event
   loop without waiting for it; it returns to the engine loop after a step when that has work
   (a queued or cancelled request, another model-thread call such as an adapter load, the end
   of a model host's turn slice), so no request waits more than the step in flight for it.

Time to first token under load (the scheduling rule, as vLLM's and SGLang's schedulers admit
waiting prefills at the next step): a request that arrives while the batch decodes, and fits,
waits for at most the one decode step in flight, then its prefill, before its first token; it
never waits behind a decode step that starts after it arrived (tested in engine steps,
:attr:`ModelRuntime.first_token_waits`). By default (``admit_mid_step``) it does not even wait
for the rest of the step in flight: a forward pre-hook on every decoder layer, on only during
decode steps, sees the arrival at the next layer boundary, admits the queue's head by the same
first-in-first-out rule and bounds, and runs its prefill right there, nested in the step (the
step's rows are paused between two layers, their hidden states untouched); the first token goes
out at once and the new rows join the batch when the step ends. The nested pass must run in the
step's LoRA mode (base with LoRA layers off, or grouped rows), whose row plan is saved and put
back around it; where the step's adapters cannot run grouped and pass PEFT's ``adapter_names``,
the request waits for the step instead. A resident adapter is pinned on arrival without a
model-thread hop. The prefill is not chunked: on one CPU thread a prompt's prefill is
compute-bound, so chunking it would only spread the same work over more steps; a reused prompt
prefix (:mod:`~.prefix_cache`) is what makes it shorter.

No starvation: every running row advances by one token on every step, whatever its length, so
a long generation slows a short one by its share of the batch but never blocks it; and the
queue is strictly first in, first out (a request that does not fit yet is not overtaken by
smaller ones behind it), so every queued request is admitted once the requests ahead of it have
room. Beyond ``max_queued`` waiting requests a new one is refused at once with :class:`Busy`
(``RESOURCE_EXHAUSTED``, the numbers in the message).

Greedy output is the same as the request's solo output: padding is masked out and positions
count real tokens only, so a row's numbers differ from its solo run by float rounding only
(tested: 16 interleaved requests over 3 adapters and the base).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Callable, Sequence

from opentinker_trainer.inference.adapters import AdapterNotFound, AdapterRegistry
from opentinker_trainer.inference.batch import BASE_ROW, DecodeBatch, Member
from opentinker_trainer.inference.engine import FINISH_STOP, SamplingParams, cache_kwarg
from opentinker_trainer.inference.packed import available as packing_available
from opentinker_trainer.inference.packed import pack_linears
from opentinker_trainer.inference.prefix_cache import PrefixCache
from opentinker_trainer.inference.text import TextStream

__all__ = ["BadRequest", "WrongModel", "Busy", "Prepared", "StepEvent", "RuntimeConfig", "SharedModel", "ModelRuntime"]

MAX_SAMPLES = 64
MAX_STOPS = 8
#: Prompt-lookup draft tokens a greedy request's decode step checks at most (:mod:`~.prompt_lookup`).
MAX_DRAFT = 6
#: Rows up to which decode steps check drafts. With more rows every extra position adds its
#: compute to a step that already is compute-bound.
MAX_DRAFTING_ROWS = 2
#: Adapter ids :attr:`ModelRuntime.served_adapters` keeps: the most recently served. Listing them
#: checks each one, so the bound keeps ``/v1/models`` cheap; an id past it is still accepted.
MAX_SERVED_ADAPTERS = 64


class BadRequest(ValueError):
    """INVALID_ARGUMENT; the message names the field and what was expected."""


class WrongModel(LookupError):
    """NOT_FOUND: the request names a base model this server does not serve."""


class Busy(RuntimeError):
    """RESOURCE_EXHAUSTED: the batch is full and ``max_queued`` requests already wait."""


@dataclass(frozen=True)
class Prepared:
    """A validated request: prompt token ids, sampling settings and adapter (None = base)."""

    prompt_ids: list[int]
    params: SamplingParams
    adapter: str | None


@dataclass
class StepEvent:
    """What one step added to sample ``index``: text delta, tokens, logprobs, and its finish
    reason when it ended. ``usage`` (prompt tokens, completion tokens) is set on the last event."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    usage: tuple[int, int] | None = None


def _context_length(model) -> int:
    cfg = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


@dataclass(frozen=True)
class RuntimeConfig:
    """The bounds and switches of a :class:`ModelRuntime`; a task's ``inference`` spec sets them.

    Attributes:
        max_resident_adapters: adapters kept loaded at most; the least recently used is evicted.
        max_concurrent: requests decoding in the batch at once.
        max_batch_sequences: rows decoding at once; a request with ``n`` samples takes ``n``.
        max_batch_tokens: key/value tokens the batch reserves, ``n * (prompt + max_tokens)`` per
            request; a request needing more on its own is refused with :class:`BadRequest`.
        max_queued: requests waiting for room; beyond, :class:`Busy`.
        max_prefill_tokens: prompt tokens prefilled per step; at least one request per step.
        prefix_cache_tokens: prompt-prefix key/values kept for reuse, in tokens; 0 turns it off.
        prefix_block: the reuse granularity in tokens. A prompt that starts with the same complete
            blocks as an earlier one on the same adapter prefills only the rest (:mod:`~.prefix_cache`).
        admit_mid_step: a request arriving during a decode step is prefilled between two of the
            step's layers, so its first token does not wait for the rest of the step; False: at
            the next engine step.
        packed_weights: on CPU, the model's float32 ``Linear`` layers run on their weights
            packed for oneDNN, which replace the plain ones (:mod:`~.packed`). Not on a model
            host's shared model, on other devices, or with False: the layers run as they are.

    Raises:
        ValueError: a bound out of range, naming the field.
    """

    max_resident_adapters: int = 8
    max_concurrent: int = 16
    max_batch_sequences: int = 64
    max_batch_tokens: int = 65536
    max_queued: int = 64
    max_prefill_tokens: int = 2048
    prefix_cache_tokens: int = 1024
    prefix_block: int = 16
    admit_mid_step: bool = True
    packed_weights: bool = True

    def __post_init__(self) -> None:
        for name in ("max_resident_adapters", "max_concurrent", "max_batch_sequences", "max_batch_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {getattr(self, name)}")
        for name in ("max_prefill_tokens", "prefix_block"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {getattr(self, name)}")
        for name in ("max_queued", "prefix_cache_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: expected an integer >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class SharedModel:
    """A runtime's place on a model host, whose model training tenants use too.

    Attributes:
        host: the model host; the runtime's adapters live on its model
            (:class:`~.adapters.AdapterRegistry`).
        adapter_prefix: the PEFT name prefix of this runtime's adapters on the host's model.
        turn: the serving tenant's turn (``WorkerContext.turn``). Every model-thread call (an
            adapter load, a prefill pass, a decode step of the batch) runs as one turn, so no
            training tenant's step runs in the middle of it, and no forward pass of this runtime
            in the middle of a training step. The caller builds the runtime inside a turn too: it
            puts the model in eval mode.
        turn_slice: seconds a turn may be kept over several such calls while the batch has work
            (the serving tenant's ``Tenant.turn_slice``: as long as a training tenant's last turn,
            so serving and each training tenant get about equal model time per cycle).
        live: ``adapter name -> pinned version or None``, called on the model thread in a turn
            when a request arrives. For a training tenant of the host it copies that tenant's
            adapter as it is now, between two of its steps, and pins it under
            ``<task id>@<step>`` (:meth:`~.adapters.AdapterRegistry.acquire_copy`). None: the
            request goes by ``resolve`` as anywhere.
    """

    host: object
    adapter_prefix: str
    turn: Callable[[], "contextlib.AbstractContextManager"]
    turn_slice: Callable[[], float]
    live: Callable[[str], str | None] | None = None


class ModelRuntime:
    """A base model, its tokenizer and adapters, served to concurrent requests.

    Args:
        model_name: the name requests use for the base model (the task's ``spec.model``).
        tokenizer, model: loaded by the caller; the model is put in eval mode here.
        stop_token_ids: ids that end a sample (EOS, end of turn).
        resolve: adapter name -> checkpoint folder (may block: runs off the model thread);
            raises :class:`~.adapters.AdapterNotFound` / :class:`~.adapters.AdapterRefused`.
        config: bounds and switches (:class:`RuntimeConfig`).
        shared: on a model host, the runtime's place there (:class:`SharedModel`); None: the
            runtime owns ``model``.

    Versions: a request naming an adapter by its task id alone is pinned, when it arrives, to the
    version ``shared.live(name)`` gives (a training tenant's adapter on the same host, after its
    newest step) or else ``resolve.current(name)`` names (a running training task's newest
    checkpoint, ``<task id>@<step>``; :meth:`~.resolve.SchedulerResolver.current`), and keeps it to
    its last token; a resolver without ``current`` leaves the name as it is.
    """

    def __init__(
        self,
        *,
        model_name: str,
        tokenizer,
        model,
        stop_token_ids: Sequence[int],
        resolve: Callable[[str], Path] | None = None,
        config: RuntimeConfig = RuntimeConfig(),
        shared: SharedModel | None = None,
    ) -> None:
        model.eval()
        self.config = config
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.registry = AdapterRegistry(
            model,
            resolve,
            max_resident=config.max_resident_adapters,
            shared=shared.host if shared is not None else None,
            prefix=shared.adapter_prefix if shared is not None else "",
        )
        self._turn = shared.turn if shared is not None else None
        self._turn_slice = shared.turn_slice if shared is not None else None
        self._live = shared.live if shared is not None else None
        self._held: tuple | None = None  # (the turn's context manager, when taken, was training)
        self.stop_token_ids = list(stop_token_ids)
        self.context_length = _context_length(model)
        #: Adapter names as requests gave them (``<task id>`` or ``<task id>@<step>``) that were
        #: loaded and admitted, with the unix time of the first: ids ``model`` accepts, resident or
        #: not. The :data:`MAX_SERVED_ADAPTERS` most recently served are kept, least recently served
        #: first; an id that no longer resolves (its checkpoint deleted: AdapterNotFound) is dropped
        #: when a request or :meth:`resolvable_adapters` finds it so.
        self.served_adapters: collections.OrderedDict[str, float] = collections.OrderedDict()
        self.running = 0  # requests between their start and the release of their row and adapter
        self.steps = 0  # batch steps run (all requests): prefill passes and decode steps
        self.decode_steps = 0  # decode steps of the whole batch run
        #: For recent requests: decode steps the batch ran between the request's arrival in the
        #: queue and its first token (0 or 1 when it did not have to wait for room).
        self.first_token_waits: collections.deque[int] = collections.deque(maxlen=1024)
        self.admitted_mid_step = 0  # requests prefilled between two layers of a decode step
        self.max_batch_rows_seen = 0  # most rows one step decoded (a figure for tests and benchmarks)
        self.decode_tokens = 0  # tokens chosen by decode steps, kept draft tokens included
        self.drafted_tokens = 0  # prompt-lookup draft tokens checked by decode steps
        self.kept_draft_tokens = 0  # of those, the ones greedy decoding chose too
        self._queue: collections.deque[_Job] = collections.deque()
        self._admitted: list[_Job] = []
        self._batch: DecodeBatch | None = None  # the running rows; None when there are none
        self._engine: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._device = next(model.parameters()).device
        self._cache_kw = cache_kwarg(model)
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self._config = getattr(model, "config", None)
        # Admission between two layers of a decode step (see _layer_hook): set on arrival.
        self._arrivals = threading.Event()
        self._admit_lock = threading.Lock()
        self._early_jobs: list[_Job] = []  # admitted during the decode step in flight
        self._early_rows: list[tuple] = []  # their prefilled rows, added when it ends
        self._in_early = False
        self._calls_waiting = 0  # model-thread calls submitted and not started yet
        self._stopping = False  # the engine is being cancelled: decode steps stop
        self._layers = _decoder_layers(model)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.prefix = PrefixCache(block=config.prefix_block, max_tokens=config.prefix_cache_tokens)
        self.registry.on_delete = self.prefix.forget
        if config.packed_weights and shared is None and packing_available(self._device):
            pack_linears(model)

    def close(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)
        self._release_turn()  # the model thread is gone: a turn it held goes back from here

    async def stop_engine(self) -> None:
        """Cancel the engine task (the server is stopping); waiting requests get cancelled."""
        if self._engine is not None and not self._engine.done():
            self._stopping = True  # the model thread stops after the decode step in flight
            self._engine.cancel()
            try:
                await self._engine
            except asyncio.CancelledError:
                pass
        self._engine = None
        if self._held is not None:  # a turn kept for the next step goes back with the engine
            await asyncio.get_running_loop().run_in_executor(self._thread, self._release_turn)

    async def _on_model_thread(self, fn, *args):
        """``fn(*args)`` on the model thread. While the call waits there, the decode steps in
        flight stop after the current one (:meth:`_decode_steps`), so the call waits one step."""
        if self._turn is not None:
            fn, args = self._in_turn, (fn, *args)
        call = _Call(fn, args)
        with self._admit_lock:
            self._calls_waiting += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._thread, self._start_call, call)
        finally:
            self._end_wait(call)  # a call cancelled before it started waits no more

    def _start_call(self, call: "_Call"):
        self._end_wait(call)
        return call.fn(*call.args)

    def _end_wait(self, call: "_Call") -> None:
        with self._admit_lock:
            if not call.waited:
                call.waited = True
                self._calls_waiting -= 1

    def _in_turn(self, fn, *args):
        """Model thread, on a shared model: ``fn(*args)`` inside the serving tenant's turn. The
        turn is taken if not held, and kept for the next call while it has lasted less than
        ``turn_slice()`` seconds; it is given back after that, after an error, and when the
        engine has nothing left to run (:meth:`_release_turn`)."""
        if self._held is None:
            cm = self._turn()
            cm.__enter__()
            self._held = (cm, time.perf_counter(), self.registry.enter_turn())
        done = False
        try:
            result = fn(*args)
            done = True
            return result
        finally:
            since = self._held[1]
            if not done or self._turn_slice is None or time.perf_counter() - since >= self._turn_slice():
                self._release_turn()

    def _release_turn(self) -> None:
        """Give the serving tenant's turn back (the model as the next tenant expects it)."""
        if self._held is None:
            return
        cm, _, training = self._held
        self._held = None
        self.prefix.clear()  # the next tenants may change the weights the cached prefixes came from
        try:
            self.registry.leave_turn(training)
        finally:
            cm.__exit__(None, None, None)

    def unload_adapters(self) -> None:
        """Take this runtime's adapters off the model (in a turn on a shared model); after
        :meth:`close`, when the serving tenant ends."""
        if self._turn is None:
            self.registry.unload_all()
            return
        self._in_turn(self.registry.unload_all)
        self._release_turn()

    async def current_adapter(self, name: str | None) -> str | None:
        """The adapter version a request naming ``name`` is served (see the class docstring)."""
        current = getattr(self.registry.resolve, "current", None)
        if name is None or current is None:
            return name
        return await asyncio.to_thread(current, name)

    # --- validation ------------------------------------------------------------------------
    def prepare(
        self,
        *,
        model: str,
        adapter: str,
        text: str | None,
        messages: list[tuple[str, str]] | None,
        params: SamplingParams,
    ) -> Prepared:
        """Check a request and tokenize its prompt.

        Raises:
            BadRequest: no prompt, bad sampling values, or prompt + max_tokens beyond the context.
            WrongModel: ``model`` is neither empty nor the served one.
        """
        if model and model != self.model_name:
            raise WrongModel(f"model {model!r} is not served here; this server serves {self.model_name!r}")
        _check_params(params)
        if messages is not None:
            if not messages:
                raise BadRequest("messages: expected at least one chat message")
            for i, (role, _) in enumerate(messages):
                if role not in ("system", "user", "assistant"):
                    raise BadRequest(f"messages[{i}].role: expected system, user or assistant, got {role!r}")
            if not getattr(self.tokenizer, "chat_template", None):
                raise BadRequest("messages: this model has no chat template; send the prompt as text")
            rendered = self.tokenizer.apply_chat_template(
                [{"role": r, "content": c} for r, c in messages], tokenize=False, add_generation_prompt=True
            )
            prompt_ids = list(self.tokenizer(rendered, add_special_tokens=False)["input_ids"])
        elif text is not None:
            if not text:
                raise BadRequest("text: expected a non-empty prompt")
            prompt_ids = list(self.tokenizer(text)["input_ids"])
        else:
            raise BadRequest("prompt: expected messages or text")
        if not prompt_ids:
            raise BadRequest("prompt: it tokenizes to no tokens")
        if len(prompt_ids) + params.max_tokens > self.context_length:
            raise BadRequest(
                f"sampling.max_tokens: the prompt has {len(prompt_ids)} tokens and max_tokens is {params.max_tokens}, "
                f"{len(prompt_ids) + params.max_tokens} in all, "
                f"beyond the model's context of {self.context_length} tokens"
            )
        need = params.n * (len(prompt_ids) + params.max_tokens)
        if need > self.config.max_batch_tokens:
            raise BadRequest(
                f"sampling.max_tokens: n * (prompt + max_tokens) = {params.n} * ({len(prompt_ids)} + "
                f"{params.max_tokens}) = {need} tokens, more than this server's batch holds "
                f"(max_batch_tokens {self.config.max_batch_tokens})"
            )
        if params.n > self.config.max_batch_sequences:
            raise BadRequest(
                f"sampling.n: expected at most {self.config.max_batch_sequences} (max_batch_sequences), got {params.n}"
            )
        return Prepared(prompt_ids, params, adapter or None)

    # --- running -----------------------------------------------------------------------------
    async def run(self, req: Prepared) -> AsyncIterator[StepEvent]:
        """Generate; yields events as tokens are chosen, the last one carrying ``usage``.

        The request joins the running batch at the next step when it fits
        (``max_concurrent`` requests, ``max_batch_sequences`` rows, ``max_batch_tokens``
        reserved tokens), else waits in the queue (first in, first out).

        Raises (before the first event): :class:`Busy` (the queue is full), and the adapter
        errors of :meth:`AdapterRegistry.acquire` (not found, refused, all slots busy).
        """
        self._start_engine()
        job = _Job(req, asyncio.Queue())
        if self._must_wait(job) and len(self._queue) >= self.config.max_queued:
            raise Busy(self._full_message())
        self.running += 1
        named = req.adapter  # the id the request gave; ``req.adapter`` becomes the version served
        try:
            if named is not None:
                # The version is fixed now, on arrival: on a model host the training tenant's
                # adapter as it is between its steps (a pinned copy), else a running task's
                # newest checkpoint.
                try:
                    live = await self._on_model_thread(self._live, req.adapter) if self._live is not None else None
                    if live is not None:
                        job.req = req = dataclasses.replace(req, adapter=live)
                        job.pinned = True
                    else:
                        version = await self.current_adapter(req.adapter)
                        if version != req.adapter:
                            job.req = req = dataclasses.replace(req, adapter=version)
                    # A resident adapter is pinned right here (a lock, no model-thread hop behind the
                    # step in flight); only a load runs on the model thread.
                    if not job.pinned and not self.registry.pin_resident(req.adapter):
                        path = await asyncio.to_thread(self.registry.resolve, req.adapter)
                        await self._on_model_thread(self.registry.acquire, req.adapter, path)
                except AdapterNotFound:
                    self.served_adapters.pop(named, None)  # no longer an id ``model`` accepts
                    raise
                job.pinned = True
            if self._must_wait(job) and len(self._queue) >= self.config.max_queued:
                raise Busy(self._full_message())  # the queue filled while the adapter loaded
            if named is not None:
                self._record_served(named)
            decode_text = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
            job.member = Member.create(req.prompt_ids, req.params, req.adapter, self.stop_token_ids, self._device)
            job.streams = [TextStream(decode_text, req.params.stop) for _ in range(req.params.n)]
            with self._admit_lock:  # against the model thread deciding to run one more decode step
                job.arrived_at = self.decode_steps
                self._queue.append(job)
            self._wake.set()
            self._arrivals.set()
            while True:
                item = await job.events.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            with self._admit_lock:  # against an admission mid-step on the model thread
                job.cancelled = True
            if job.admitted:
                self._wake.set()  # the engine drops its rows before the next step, then finalizes
            else:
                self._finalize(job)

    def _record_served(self, name: str) -> None:
        """Record adapter id ``name`` in :attr:`served_adapters` as the most recently served,
        keeping the time it was first served; the least recently served beyond
        :data:`MAX_SERVED_ADAPTERS` go."""
        self.served_adapters[name] = self.served_adapters.pop(name, time.time())
        while len(self.served_adapters) > MAX_SERVED_ADAPTERS:
            self.served_adapters.popitem(last=False)

    async def resolvable_adapters(self, names: Sequence[str]) -> list[str]:
        """Those of ``names`` (ids in :attr:`served_adapters`) a request can still use: a resident
        one as it is, any other unless resolving it finds it gone (:class:`AdapterNotFound`: no
        such task, its checkpoint deleted), which drops it from :attr:`served_adapters`. One
        refused now (a training task with no checkpoint yet, served live on a model host) or that
        cannot be checked now (the scheduler is unreachable) is kept and returned.

        A resolver with a ``check`` method (:meth:`~.resolve.SchedulerResolver.check`) is asked
        that, which reads the checkpoint's record without fetching it; else ``resolve`` itself.
        """
        check = getattr(self.registry.resolve, "check", self.registry.resolve)

        async def usable(name: str) -> bool:
            if self.registry.is_resident(name):
                return True
            try:
                await asyncio.to_thread(check, name)
            except AdapterNotFound:
                self.served_adapters.pop(name, None)
                return False
            except Exception:  # noqa: BLE001 - refused now or unknown (no scheduler): listed, checked again next time
                return True
            return True

        kept = await asyncio.gather(*(usable(n) for n in names))
        return [n for n, ok in zip(names, kept) if ok]

    @property
    def queued(self) -> int:
        """Requests waiting for room in the batch."""
        return sum(1 for j in list(self._queue) if not j.cancelled)

    @property
    def batch_rows(self) -> int:
        """Sequences (rows) in the running batch now."""
        return self._batch.rows if self._batch is not None else 0

    def _finalize(self, job: "_Job") -> None:
        if job.finalized:
            return
        job.finalized = True
        if job.pinned:
            self.registry.release(job.req.adapter)
        self.running -= 1

    def _load(self, jobs) -> tuple[int, int, int]:
        live = [j for j in jobs if not (j.cancelled or j.member.done)]
        return len(live), sum(j.member.n for j in live), sum(j.member.reserved_tokens() for j in live)

    def _fits(self, load: tuple[int, int, int], req: Prepared) -> bool:
        count, rows, tokens = load
        p = req.params
        return (
            count + 1 <= self.config.max_concurrent
            and rows + p.n <= self.config.max_batch_sequences
            and tokens + p.n * (len(req.prompt_ids) + p.max_tokens) <= self.config.max_batch_tokens
        )

    def _must_wait(self, job: "_Job") -> bool:
        if any(not j.cancelled for j in list(self._queue)):
            return True
        return not self._fits(self._load(self._admitted), job.req)

    def _full_message(self) -> str:
        count, rows, tokens = self._load(self._admitted)
        cfg = self.config
        return (
            f"the request queue is full: {self.queued} requests waiting (max_queued_requests {cfg.max_queued}) "
            f"behind {count} decoding (max_concurrent_requests {cfg.max_concurrent}; "
            f"{rows} of {cfg.max_batch_sequences} sequences, {tokens} of {cfg.max_batch_tokens} batch tokens); "
            "retry later"
        )

    def _start_engine(self) -> None:
        if self._engine is None or self._engine.done():
            self._stopping = False
            self._wake = asyncio.Event()
            self._loop = asyncio.get_running_loop()
            self._engine = asyncio.get_running_loop().create_task(self._engine_loop(), name="inference-engine")

    async def _engine_loop(self) -> None:
        """Owns the batch: every iteration drops finished and cancelled rows, admits queued
        requests first in first out and prefills them (their first tokens are handed out at
        once), then runs decode steps of every row on the model thread and hands out their
        tokens (:meth:`_decode_steps`)."""
        while True:
            if not self._admitted and not self._queue:
                if self._held is not None:  # nothing to run: the other tenants get the model
                    await asyncio.get_running_loop().run_in_executor(self._thread, self._release_turn)
                    continue
                self._wake.clear()
                await self._wake.wait()
                continue
            gone = [j for j in self._admitted if j.cancelled or j.member.done]
            kept = [j for j in self._admitted if j not in gone]
            admit = self._take(kept)
            self._admitted = kept + admit
            try:
                if admit or gone:
                    # Prefill first, on its own: the new requests' first tokens go out before the
                    # running rows' next decode step (which then includes the new rows).
                    results = await self._on_model_thread(self._prefill_step, admit, {j.member for j in gone})
                    for job in gone:
                        self._finalize(job)
                    self._deliver(results)
                    for job in admit:
                        if not job.cancelled and job.member.tokens[0]:
                            self.first_token_waits.append(self.decode_steps - job.arrived_at)
                if any(not j.finalized for j in self._admitted):
                    try:
                        results = await self._on_model_thread(self._decode_steps)
                    finally:
                        early, self._early_jobs = self._early_jobs, []
                        self._admitted.extend(early)  # admitted mid-step: their rows joined the batch
                    self._deliver(results)
            except Exception as exc:  # noqa: BLE001 - every request in the batch gets the error
                self._batch = None
                for job in gone + self._admitted:
                    job.events.put_nowait(exc)
                    self._finalize(job)
                self._admitted = []
                continue
            self._admitted = [j for j in self._admitted if not j.finalized]

    def _take(self, kept: list["_Job"]) -> list["_Job"]:
        """Pop from the queue the requests that join next to ``kept``: first in, first out while
        they fit the bounds, at most ``max_prefill_tokens`` prompt tokens (at least one request).
        Marks them admitted. Engine loop, or the model thread while the engine loop waits for it
        (the loop thread then only appends to the queue)."""
        admit: list[_Job] = []
        budget = self.config.max_prefill_tokens
        load = self._load(kept)
        while self._queue:
            job = self._queue[0]
            with self._admit_lock:
                if job.cancelled:
                    self._queue.popleft()
                    continue
                size = len(job.req.prompt_ids)
                if not self._fits(load, job.req) or (admit and size > budget):
                    break  # strict FIFO: nothing overtakes the head of the queue
                self._queue.popleft()
                job.admitted = True
            admit.append(job)
            budget -= size
            load = self._load([*kept, *admit])
        return admit

    def _can_admit_mid_step(self) -> bool:
        """Model thread, in a decode step: whether a prefill may run between two of its layers.
        Only when the step's rows run the base with LoRA off (all on the base, or grouped LoRA):
        the prefill then runs in that same mode, and the step's row plan is put back after it."""
        if not self.config.admit_mid_step:
            return False
        return self.registry.rows_mode()

    def _layer_hook(self, module, args) -> None:
        """Forward pre-hook of every decoder layer during a decode step: a request that arrived
        meanwhile (and fits) is prefilled right here, its first token handed out, and its rows
        join the batch when the step ends (:meth:`_prefill_mid_step`)."""
        if self._arrivals.is_set() and not self._in_early:
            # Requests arriving while such a prefill runs are admitted together at the next layer.
            self._in_early = True
            try:
                self._prefill_mid_step()
            finally:
                self._in_early = False
        return None

    def _prefill_mid_step(self) -> None:
        self._arrivals.clear()
        if not self._queue or not self._can_admit_mid_step():
            return
        kept = [j for j in [*self._admitted, *self._early_jobs] if not (j.cancelled or j.member.done)]
        jobs = self._take(kept)
        if not jobs:
            return
        self._early_jobs.extend(jobs)
        self.admitted_mid_step += len(jobs)
        batch = self._batch or self._new_batch()
        saved = self.registry.save_rows()
        try:
            members = [j.member for j in jobs]
            logits, cache, mask = batch.prefill(members)
            chosen = {job: job.member.sample(lg) for job, lg in zip(jobs, logits)}
        finally:
            self.registry.restore_rows(saved)
        self._early_rows.append((members, cache, mask))
        self.steps += 1
        events = {job: self._events(job, picked) for job, picked in chosen.items()}
        for job in events:
            if not job.cancelled and job.member.tokens[0]:
                self.first_token_waits.append(self.decode_steps - job.arrived_at)
        self._loop.call_soon_threadsafe(self._deliver, events)

    def _deliver(self, results: dict) -> None:
        """Hand each request the events of one step (its rows left the batch when done). The
        model thread may have run more steps meanwhile: a request is done here when these events
        end with its ``usage``, not when its member is done by now."""
        for job, events in results.items():
            done = bool(events) and events[-1].usage is not None
            if done:
                self._finalize(job)  # its rows left the batch in that step: release before answering
            if job.cancelled:
                continue
            for event in events:
                job.events.put_nowait(event)
            if done:
                job.events.put_nowait(_END)

    def _events(self, job: "_Job", chosen) -> list[StepEvent]:
        """Model thread: text deltas and stop strings of the tokens one step chose for ``job``."""
        m = job.member
        runs: dict[int, list[tuple[int, float, str | None]]] = {}
        for i, tok, lp, reason in chosen:
            runs.setdefault(i, []).append((tok, lp, reason))
        events = []
        for i, run in runs.items():
            stream = job.streams[i]
            start = len(m.tokens[i]) - len(run)
            text, sent, reason = "", 0, None
            for _, _, reason in run:  # token by token: a stop string ends the sample where it appears
                sent += 1
                text += stream.update(m.tokens[i][: start + sent], final=reason is not None)
                if stream.stopped:
                    break
            if stream.stopped and reason is None:
                reason = FINISH_STOP
                m.cut(i, start + sent)
            run = run[:sent]
            events.append(StepEvent(i, text, [t for t, _, _ in run], [lp for _, lp, _ in run], reason))
        if m.done:
            completion = sum(len(t) for t in m.tokens)
            events.append(StepEvent(0, usage=(len(job.req.prompt_ids), completion)))
        return events

    def _model_for(self, names):
        """The model to call and its extra arguments for rows of adapters ``names``. Rows with
        adapters run grouped by adapter (:meth:`AdapterRegistry.activate_rows`: the base once for
        all rows, each adapter's LoRA over its rows only), rows all on the base with LoRA off;
        where the adapters cannot run grouped, rows all of one adapter run it activated and mixed
        rows pass PEFT's ``adapter_names``."""
        reg = self.registry
        if reg.model is reg.base:
            return reg.base, {}
        if all(n == BASE_ROW for n in names):
            reg.activate(None)
            return reg.base, {}
        if reg.activate_rows([None if n == BASE_ROW else n for n in names]):
            return reg.base, {}
        if len(set(names)) == 1:
            reg.activate(None if names[0] == BASE_ROW else names[0])
            return reg.base, {}
        reg.activate_mixed()
        return reg.model, {"adapter_names": reg.peft_names(names)}

    def _new_batch(self) -> DecodeBatch:
        return DecodeBatch(
            model_for=self._model_for,
            cache_kw=self._cache_kw,
            device=self._device,
            prefix=self.prefix,
            config=self._config,
        )

    def _prefill_step(self, admit: list["_Job"], gone: set[Member]) -> dict:
        """Model thread: drop the ``gone`` rows, prefill ``admit`` in one pass and choose
        each one's first token; the new rows join the batch. Returns each admitted request's events."""
        self._drop(gone)
        chosen: dict = {}
        if admit:  # one prefill pass for every admitted prompt
            batch = self._batch or self._new_batch()
            members = [j.member for j in admit]
            logits, cache, mask = batch.prefill(members)
            for job, lg in zip(admit, logits):
                chosen[job] = job.member.sample(lg)
            batch.add(members, cache, mask)
            self._batch = batch
        return self._finish_step(chosen)

    def _decode_steps(self) -> dict:
        """Model thread: decode steps of the batch back to back; returns the last step's events.

        The events of each step before it go to the event loop at once, so the model thread does
        not wait for the loop between two steps. It stops after a step when the engine loop has
        work (:meth:`_engine_has_work`). The decision and a request's arrival take the same lock:
        a request that arrives after it waits for the one step then in flight, no more."""
        while True:
            results = self._decode_step()
            early, self._early_jobs = self._early_jobs, []
            self._admitted.extend(early)  # admitted mid-step: their rows joined the batch
            with self._admit_lock:
                self.decode_steps += 1
                if self._engine_has_work():
                    return results
            self._loop.call_soon_threadsafe(self._deliver, results)

    def _engine_has_work(self) -> bool:
        """Model thread, between two decode steps: whether the engine loop must run before the
        next one. It must when no row is left; a request waits in the queue (admitted only there
        when it cannot join mid-step); a running request was cancelled (its row leaves first);
        another model-thread call waits (an adapter load); the engine stops; or, on a model
        host, the serving tenant's turn has lasted its slice (the training tenants' turn)."""
        if self._batch is None or self._queue or self._calls_waiting or self._stopping:
            return True
        if any(j.cancelled and not j.member.done for j in self._admitted):
            return True
        if self._turn is not None:
            held = self._held
            return held is None or self._turn_slice is None or time.perf_counter() - held[1] >= self._turn_slice()
        return False

    def _decode_step(self) -> dict:
        """Model thread: one decode step of every row in the batch; returns each request's events.

        Requests that arrive during the step are prefilled between two of its layers
        (:meth:`_layer_hook`); their rows join the batch after it."""
        chosen: dict = {}
        jobs = {j.member: j for j in self._admitted}
        handles = [layer.register_forward_pre_hook(self._layer_hook) for layer in self._layers]
        try:
            if self._batch is not None:
                batch = self._batch
                # Only with few rows is a step bound by reading the weights, so drafts cost little.
                room = MAX_DRAFT if batch.rows <= MAX_DRAFTING_ROWS else 0
                drafts = {m: m.draft(room) for m in batch.members} if room else {}
                kept: dict[Member, int] = {}
                for m, logits in zip(batch.members, batch.forward(drafts)):
                    if drafts.get(m):
                        chosen[jobs[m]], kept[m] = m.verify(logits, drafts[m])
                        self.drafted_tokens += len(drafts[m])
                        self.kept_draft_tokens += kept[m]
                    else:
                        chosen[jobs[m]] = m.sample(logits)
                batch.rewind(kept)
                self.decode_tokens += sum(len(picked) for picked in chosen.values())
        finally:
            for handle in handles:
                handle.remove()
            early, self._early_rows = self._early_rows, []
        if early:
            batch = self._batch or self._new_batch()
            for members, cache, mask in early:
                batch.add(members, cache, mask)
            batch.remove({m for members, _, _ in early for m in members if m.done})
            self._batch = batch if batch.members else None
        return self._finish_step(chosen)

    def _finish_step(self, chosen: dict) -> dict:
        if chosen:
            self.steps += 1
            self.max_batch_rows_seen = max(self.max_batch_rows_seen, self.batch_rows)
        events = {job: self._events(job, picked) for job, picked in chosen.items()}
        self._drop({job.member for job in events if job.member.done})
        return events

    def _drop(self, gone: set[Member]) -> None:
        if not gone:
            return
        if self._batch is not None:
            self._batch.remove(gone)
            if not self._batch.members:
                self._batch = None


_END = object()


def _decoder_layers(model) -> list:
    """The decoder layers of ``model`` (``get_decoder().layers``), or none when not found."""
    try:
        layers = getattr(model.get_decoder(), "layers", None)
    except (AttributeError, NotImplementedError, ValueError):
        return []
    return list(layers) if layers is not None else []


@dataclass(eq=False)
class _Call:
    """A call for the model thread; ``waited`` once it started or its caller stopped waiting."""

    fn: Callable
    args: tuple
    waited: bool = False


@dataclass(eq=False)
class _Job:
    """A request inside the runtime: its batch member, text streams and event queue."""

    req: Prepared
    events: asyncio.Queue
    member: Member | None = None
    streams: list[TextStream] = field(default_factory=list)
    pinned: bool = False
    arrived_at: int = 0  # ModelRuntime.decode_steps when it joined the queue
    admitted: bool = False
    cancelled: bool = False
    finalized: bool = False


def _check_params(p: SamplingParams) -> None:
    def bad(field: str, expected: str, got) -> BadRequest:
        return BadRequest(f"sampling.{field}: expected {expected}, got {got!r}")

    if not (math.isfinite(p.temperature) and 0.0 <= p.temperature <= 10.0):
        raise bad("temperature", "a number in [0, 10] (0 = greedy)", p.temperature)
    if not (math.isfinite(p.top_p) and 0.0 < p.top_p <= 1.0):
        raise bad("top_p", "a number in (0, 1]", p.top_p)
    if p.top_k < 0:
        raise bad("top_k", "an integer >= 0 (0 = off)", p.top_k)
    if p.max_tokens < 1:
        raise bad("max_tokens", "an integer >= 1", p.max_tokens)
    if not 1 <= p.n <= MAX_SAMPLES:
        raise bad("n", f"an integer in [1, {MAX_SAMPLES}]", p.n)
    if len(p.stop) > MAX_STOPS:
        raise bad("stop", f"at most {MAX_STOPS} stop strings", f"{len(p.stop)} strings")
    for i, s in enumerate(p.stop):
        if not 1 <= len(s) <= 256:
            raise BadRequest(f"sampling.stop[{i}]: expected a string of 1..256 characters, got {s[:20]!r}")
