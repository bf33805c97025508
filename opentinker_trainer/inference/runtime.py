"""The served model: one base model, its adapters, one model thread, bounded concurrent requests.

Every forward pass and every adapter load runs on a single model thread, one decode step at a
time; concurrent requests take turns step by step (first come, first served per step), and each
step first activates its own request's adapter (or none). So requests never see each other's
adapter, and a long request does not hold back a short one for its whole length.

Request flow (:meth:`ModelRuntime.run`): validate and tokenize (:meth:`ModelRuntime.prepare`),
take a request slot (``RESOURCE_EXHAUSTED`` beyond ``max_concurrent``), resolve the adapter
(asks the resolver off the model thread) and pin it, then yield one :class:`StepEvent` per step.
Cancelling the consumer (a client that went away) stops after the step in flight and frees the
slot and the adapter pin.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Callable, Sequence

from opentinker_trainer.inference.adapters import AdapterRegistry
from opentinker_trainer.inference.engine import FINISH_STOP, Decode, SamplingParams, cache_kwarg
from opentinker_trainer.inference.text import TextStream

__all__ = ["BadRequest", "WrongModel", "Busy", "Prepared", "StepEvent", "ModelRuntime"]

MAX_SAMPLES = 64
MAX_STOPS = 8


class BadRequest(ValueError):
    """INVALID_ARGUMENT; the message names the field and what was expected."""


class WrongModel(LookupError):
    """NOT_FOUND: the request names a base model this server does not serve."""


class Busy(RuntimeError):
    """RESOURCE_EXHAUSTED: ``max_concurrent`` requests already run."""


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


class ModelRuntime:
    """A base model, its tokenizer and adapters, served to concurrent requests.

    Args:
        model_name: the name requests use for the base model (the task's ``spec.model``).
        tokenizer, model: loaded by the caller; the model is put in eval mode here.
        stop_token_ids: ids that end a sample (EOS, end of turn).
        resolve: adapter name -> checkpoint folder (may block: runs off the model thread);
            raises :class:`~.adapters.AdapterNotFound` / :class:`~.adapters.AdapterRefused`.
        max_resident_adapters: adapters kept loaded at most (least recently used evicted).
        max_concurrent: requests running at once; more are refused with :class:`Busy`.
    """

    def __init__(
        self,
        *,
        model_name: str,
        tokenizer,
        model,
        stop_token_ids: Sequence[int],
        resolve: Callable[[str], Path] | None = None,
        max_resident_adapters: int = 8,
        max_concurrent: int = 16,
    ) -> None:
        model.eval()
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.registry = AdapterRegistry(model, resolve, max_resident=max_resident_adapters)
        self.stop_token_ids = list(stop_token_ids)
        self.context_length = _context_length(model)
        self.max_concurrent = max_concurrent
        self.running = 0
        self.steps = 0  # decode steps run (all requests)
        self._device = next(model.parameters()).device
        self._cache_kw = cache_kwarg(model)
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")

    def close(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)

    async def _on_model_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

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
        return Prepared(prompt_ids, params, adapter or None)

    # --- running -----------------------------------------------------------------------------
    async def run(self, req: Prepared) -> AsyncIterator[StepEvent]:
        """Generate; yields events as tokens are chosen, the last one carrying ``usage``.

        Raises (before the first event): :class:`Busy`, and the adapter errors of
        :meth:`AdapterRegistry.acquire` (not found, refused, all slots busy).
        """
        if self.running >= self.max_concurrent:
            raise Busy(f"{self.running} requests are running, the most this server takes (max_concurrent_requests)")
        self.running += 1
        pinned = False
        try:
            if req.adapter is not None:
                path = None
                if not self.registry.is_resident(req.adapter):
                    path = await asyncio.to_thread(self.registry.resolve, req.adapter)
                await self._on_model_thread(self.registry.acquire, req.adapter, path)
                pinned = True
            async for event in self._decode(req):
                yield event
        finally:
            if pinned:
                self.registry.release(req.adapter)
            self.running -= 1

    async def _decode(self, req: Prepared) -> AsyncIterator[StepEvent]:
        p = req.params
        decode = Decode(
            self.registry.base, req.prompt_ids, p, self.stop_token_ids, device=self._device, cache_kw=self._cache_kw
        )
        decode_text = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        streams = [TextStream(decode_text, p.stop) for _ in range(p.n)]
        while not decode.done:
            result = await self._on_model_thread(self._step, decode, req.adapter)
            for i, tok, lp in zip(result.rows, result.tokens, result.logprobs):
                reason = result.finished.get(i)
                delta = streams[i].update(decode.sample_tokens(i), final=reason is not None)
                if streams[i].stopped and reason is None:
                    reason = FINISH_STOP
                    decode.finish_sample(i, reason)
                yield StepEvent(i, delta, [tok], [lp], reason)
        completion = sum(len(decode.sample_tokens(i)) for i in range(p.n))
        yield StepEvent(0, usage=(len(req.prompt_ids), completion))

    def _step(self, decode: Decode, adapter: str | None):
        self.registry.activate(adapter)
        self.steps += 1
        return decode.step()


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
