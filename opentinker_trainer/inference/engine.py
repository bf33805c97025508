"""One request's decode loop: prefill the prompt once, then one token per step for ``n`` samples.

A :class:`Decode` is advanced by the caller one :meth:`Decode.step` at a time, so the server can
interleave steps of concurrent requests on one model (each step runs with its own request's
adapter), stop at once when a client goes away, and stream every token as it comes.

Layout: the prompt ``[1, P]`` is run once; its key/value cache is repeated to ``n`` rows
(``batch_repeat_interleave``) and the ``n`` samples decode together, ``[n, 1]`` per step. Rows
that finished keep being fed (their outputs are ignored) until all rows are done.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch

from opentinker_trainer.inference.sampling import raw_logprobs, sampling_logprobs, select

__all__ = ["SamplingParams", "StepResult", "Decode", "FINISH_STOP", "FINISH_LENGTH"]

FINISH_STOP = "stop"  # a stop token (EOS, end of turn) or a stop string
FINISH_LENGTH = "length"  # max_tokens reached


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``temperature == 0`` is greedy decoding.

    Attributes:
        max_tokens: most new tokens per sample.
        stop: strings that end a sample (the text is cut before them).
        seed: seeds this request's own ``torch.Generator``; ``None`` draws a random seed.
        n: samples of the prompt, decoded as one batch.
        ignore_eos: keep going past stop tokens (benchmarks: fixed-length outputs).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 64
    stop: tuple[str, ...] = ()
    seed: int | None = None
    n: int = 1
    ignore_eos: bool = False


@dataclass
class StepResult:
    """Tokens chosen in one step: ``tokens[i]`` / ``logprobs[i]`` for each sample ``i`` that was
    still running (``rows``); ``finished`` maps a sample that ended on this step to its reason."""

    rows: list[int]
    tokens: list[int]
    logprobs: list[float]
    finished: dict[int, str] = field(default_factory=dict)


def cache_kwarg(model) -> str:
    """Name of the KV-cache argument of ``forward``: ``cache`` (transformers 5) or
    ``past_key_values`` (older)."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    return "cache" if "cache" in inspect.signature(type(base).forward).parameters else "past_key_values"


def _cache_of(out):
    fields = getattr(type(out), "__dataclass_fields__", {})
    return out.get("cache", None) if "cache" in fields else out.past_key_values


class Decode:
    """Decoding state of one request (prompt, KV cache, sampled tokens, random generator).

    Args:
        model: a causal LM in eval mode (a PEFT model with the right adapter active when
            :meth:`step` runs is the caller's business).
        prompt_ids: the prompt's token ids.
        params: sampling settings.
        stop_token_ids: ids that end a sample (unless ``params.ignore_eos``).
        device, cache_kw: the model's device and KV-cache argument name; found from ``model``
            when omitted (pass them when another thread may be changing the model's adapters).

    Not thread-safe: call :meth:`step` from the model's thread only.
    """

    def __init__(
        self,
        model,
        prompt_ids: list[int],
        params: SamplingParams,
        stop_token_ids: list[int],
        *,
        device: torch.device | None = None,
        cache_kw: str | None = None,
    ) -> None:
        self.model = model
        self.params = params
        self.device = device if device is not None else next(model.parameters()).device
        self.prompt_len = len(prompt_ids)
        self.stop_ids = set() if params.ignore_eos else set(int(i) for i in stop_token_ids)
        self.generator = None
        if params.temperature > 0:
            self.generator = torch.Generator(device=self.device)
            if params.seed is not None:
                self.generator.manual_seed(int(params.seed))
            else:
                self.generator.seed()
        self.tokens: list[list[int]] = [[] for _ in range(params.n)]
        self.logprobs: list[list[float]] = [[] for _ in range(params.n)]
        #: Per sample, each token's log-probability under the warped distribution that drew it.
        self.sampling_logprobs: list[list[float]] = [[] for _ in range(params.n)]
        self.finish: list[str | None] = [None] * params.n
        self._prompt = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        self._cache = None
        self._last: torch.Tensor | None = None  # [n, 1] tokens fed on the next step
        self._kw = cache_kw or cache_kwarg(model)

    @property
    def done(self) -> bool:
        return all(f is not None for f in self.finish)

    def finish_sample(self, i: int, reason: str) -> None:
        """End sample ``i`` early (a stop string matched); later steps ignore it."""
        if self.finish[i] is None:
            self.finish[i] = reason

    @torch.inference_mode()
    def step(self) -> StepResult:
        """Run the model once (the whole prompt on the first call) and choose one token per
        running sample. Returns what was chosen; :attr:`done` tells when every sample ended."""
        n = self.params.n
        if self._cache is None:
            out = self.model(
                input_ids=self._prompt,
                attention_mask=torch.ones_like(self._prompt),
                use_cache=True,
                logits_to_keep=1,
            )
            cache = _cache_of(out)
            if n > 1:
                cache.batch_repeat_interleave(n)
            self._cache = cache
            logits = out.logits[:, -1, :].float().expand(n, -1)
        else:
            width = self.prompt_len + len(self.tokens[0])
            out = self.model(
                input_ids=self._last,
                attention_mask=torch.ones((n, width), dtype=torch.long, device=self.device),
                use_cache=True,
                **{self._kw: self._cache},
            )
            self._cache = _cache_of(out)
            logits = out.logits[:, -1, :].float()
        p = self.params
        chosen = select(logits, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, generator=self.generator)
        lps = raw_logprobs(logits, chosen)
        slps = sampling_logprobs(logits, chosen, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p)
        self._last = chosen.unsqueeze(1)
        result = StepResult(rows=[], tokens=[], logprobs=[])
        for i, (tok, lp, slp) in enumerate(zip(chosen.tolist(), lps.tolist(), slps.tolist())):
            self.tokens[i].append(tok)  # every row keeps the same length (the cache needs it)
            if self.finish[i] is not None:
                continue
            self.logprobs[i].append(lp)
            self.sampling_logprobs[i].append(slp)
            result.rows.append(i)
            result.tokens.append(tok)
            result.logprobs.append(lp)
            if tok in self.stop_ids:
                self.finish[i] = result.finished[i] = FINISH_STOP
            elif len(self.tokens[i]) >= p.max_tokens:
                self.finish[i] = result.finished[i] = FINISH_LENGTH
        return result

    def sample_tokens(self, i: int) -> list[int]:
        """Tokens of sample ``i`` up to where it ended (the stop token included)."""
        return self.tokens[i][: len(self.logprobs[i])]
