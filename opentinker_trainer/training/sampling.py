"""A session's sampling: several prompts decoded together, with Tinker's sampling parameters.

:func:`sample_prompts` runs every prompt of a call in one continuous batch
(:class:`opentinker_trainer.inference.batch.DecodeBatch`): one left-padded prefill pass, then one
``[B, 1]`` decode pass per token over the rows still running. Each prompt is a
:class:`~opentinker_trainer.inference.batch.Member` with its own ``torch.Generator``, so a
prompt's draws do not depend on the other prompts of the call: with a seed it samples what it
samples alone, up to the float rounding of the padded pass.

Log-probabilities (:mod:`opentinker_trainer.inference.sampling`): ``logprobs`` are the model's at
temperature 1, what a training forward computes; ``sampling_logprobs`` are under the distribution
that drew the token (temperature, top-k, top-p), which is what Tinker returns as a sampled
sequence's ``logprobs`` and what an importance ratio needs. Prompt log-probabilities are the
model's at temperature 1: position ``t`` scores prompt token ``t`` given tokens ``0 .. t-1``; the
first position has no context and is NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from opentinker_trainer.inference.batch import DecodeBatch, Member
from opentinker_trainer.inference.engine import FINISH_STOP, SamplingParams, cache_kwarg
from opentinker_trainer.inference.sampling import sampling_logprobs
from opentinker_trainer.training.errors import BadRequest

__all__ = ["MAX_TOPK_PROMPT_LOGPROBS", "PromptSamples", "SampleParams", "Sampled", "prompt_scores", "sample_prompts"]

#: Most top-k prompt log-probabilities per position (vLLM's default bound).
MAX_TOPK_PROMPT_LOGPROBS = 20


@dataclass(frozen=True)
class SampleParams:
    """How a call samples (``SamplingParams`` of ``training.proto``).

    Attributes:
        max_tokens: most tokens per completion, 1 to 4096.
        temperature: >= 0; 0 is greedy (argmax, no randomness).
        top_p: nucleus, in (0, 1].
        top_k: keep the k most likely tokens; 0 or -1: no limit.
        stop: strings that end a completion (kept in its tokens and text).
        stop_token_ids: token ids that end a completion, besides the model's own.
        ignore_eos: the model's own stop tokens do not end a completion.
        return_logprobs: fill :attr:`Sampled.logprobs` and :attr:`Sampled.sampling_logprobs`.
        prompt_logprobs: fill :attr:`PromptSamples.prompt_logprobs`.
        topk_prompt_logprobs: fill :attr:`PromptSamples.topk_prompt_logprobs` with k pairs per
            position, 0 to :data:`MAX_TOPK_PROMPT_LOGPROBS`.
    """

    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    return_logprobs: bool = False
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0

    def check(self, vocab_size: int, where: str = "") -> None:
        """Raises :class:`BadRequest` naming ``<where><field>`` and what was expected."""
        if not 1 <= self.max_tokens <= 4096:
            raise BadRequest(f"{where}max_tokens: expected 1 to 4096, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise BadRequest(f"{where}temperature: expected a number >= 0 (0 = greedy), got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise BadRequest(f"{where}top_p: expected a number in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise BadRequest(f"{where}top_k: expected a number >= 1, or 0 or -1 for no limit, got {self.top_k}")
        for i, tok in enumerate(self.stop_token_ids):
            if not 0 <= tok < vocab_size:
                raise BadRequest(f"{where}stop_token_ids[{i}]: expected a token id in [0, {vocab_size}), got {tok}")
        if not 0 <= self.topk_prompt_logprobs <= MAX_TOPK_PROMPT_LOGPROBS:
            raise BadRequest(
                f"{where}topk_prompt_logprobs: expected 0 to {MAX_TOPK_PROMPT_LOGPROBS}, "
                f"got {self.topk_prompt_logprobs}"
            )

    def engine(self, n: int, seed: int | None) -> SamplingParams:
        """The decode settings of one prompt with ``n`` samples (stop tokens: the caller's)."""
        return SamplingParams(
            temperature=float(self.temperature),
            top_p=float(self.top_p),
            top_k=max(int(self.top_k), 0),
            max_tokens=int(self.max_tokens),
            stop=tuple(self.stop),
            seed=seed,
            n=int(n),
        )


@dataclass
class Sampled:
    tokens: list[int]
    #: Each token's log-probability under the model at temperature 1: what ``forward`` computes.
    logprobs: list[float]
    text: str
    stop_reason: str  # "stop" | "length"
    #: Each token's log-probability under the distribution that drew it (temperature, top_k,
    #: top_p); 0 for a greedy token.
    sampling_logprobs: list[float] = field(default_factory=list)


@dataclass
class PromptSamples:
    """The answer to one prompt: its samples and, when asked, its prompt log-probabilities
    (one per prompt token, NaN first) and top-k pairs (one list per prompt token, empty first)."""

    prompt_tokens: list[int]
    samples: list[Sampled]
    prompt_logprobs: list[float] = field(default_factory=list)
    topk_prompt_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


def sample_prompts(
    model,
    tokenizer,
    jobs: Sequence[tuple[list[int], int, int | None]],
    params: SampleParams,
    stop_token_ids: Sequence[int],
    *,
    device: torch.device,
    pad_id: int,
    micro_batch_tokens: int,
    more: Callable[[], Sequence[tuple[list[int], int, int | None]]] | None = None,
) -> list[PromptSamples]:
    """Samples each ``(prompt, n, seed)`` of ``jobs`` from ``model`` as it is now (adapter active
    or not: the caller's business), every prompt in one continuous batch. ``params`` must be
    checked. Returns one :class:`PromptSamples` per job, in order.

    ``more``, when given, is called before the first pass and after each decode pass; the jobs it
    returns join the running batch (a prefill pass of their own, then the shared decode passes),
    and their answers follow those of ``jobs``, in the order they joined. Joining changes no
    job's draws: each prompt has its own random stream."""
    own = [] if params.ignore_eos else list(stop_token_ids)
    stop_ids = own + [t for t in params.stop_token_ids if t not in own]
    admitted: list[tuple[list[int], int, int | None]] = []
    members: list[Member] = []
    slps: dict[int, list[list[float]]] = {}
    training = model.training
    model.eval()
    try:
        batch = DecodeBatch(model_for=lambda _names: (model, {}), cache_kw=cache_kwarg(model), device=device)

        def admit(new: Sequence[tuple[list[int], int, int | None]]) -> None:
            joining = [Member.create(prompt, params.engine(n, seed), None, stop_ids, device) for prompt, n, seed in new]
            if not joining:
                return
            admitted.extend(new)
            members.extend(joining)
            slps.update({id(m): [[] for _ in range(m.n)] for m in joining})
            logits, cache, mask = batch.prefill(joining)
            for m, lg in zip(joining, logits):
                _draw(m, lg, params, tokenizer, slps[id(m)])
            batch.add(joining, cache, mask)
            batch.remove({m for m in joining if m.done})

        admit(list(jobs) + list(more() if more is not None else ()))
        while batch.members:
            running = list(batch.members)
            for m, lg in zip(running, batch.forward()):
                _draw(m, lg, params, tokenizer, slps[id(m)])
            batch.remove({m for m in running if m.done})
            if more is not None:
                admit(more())
        scores = prompt_scores(
            model,
            [prompt for prompt, _, _ in admitted],
            logprobs=params.prompt_logprobs,
            top_k=params.topk_prompt_logprobs,
            device=device,
            pad_id=pad_id,
            micro_batch_tokens=micro_batch_tokens,
        )
    finally:
        model.train(training)
    out = []
    for m, (prompt_lps, topk) in zip(members, scores):
        samples = []
        for i in range(m.n):
            toks = list(m.tokens[i])
            samples.append(
                Sampled(
                    tokens=toks,
                    logprobs=list(m.logprobs[i]) if params.return_logprobs else [],
                    text=tokenizer.decode(toks, skip_special_tokens=True),
                    stop_reason="stop" if m.finish[i] == FINISH_STOP else "length",
                    sampling_logprobs=list(slps[id(m)][i]) if params.return_logprobs else [],
                )
            )
        out.append(PromptSamples(list(m.prompt_ids), samples, prompt_lps, topk))
    return out


def _draw(m: Member, logits: torch.Tensor, params: SampleParams, tokenizer, slps: list[list[float]]) -> None:
    """One token for each running sample of ``m``; a sample whose text now holds a stop string ends."""
    chosen = m.sample(logits)
    if params.return_logprobs and chosen:
        p = m.params
        drawn = torch.tensor(m.last, dtype=torch.long, device=logits.device)
        values = sampling_logprobs(logits, drawn, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p).tolist()
        for i, _, _, _ in chosen:
            slps[i].append(values[i])
    if params.stop:
        for i, _, _, reason in chosen:
            if reason is None and any(s and s in tokenizer.decode(m.tokens[i]) for s in params.stop):
                m.finish_sample(i, FINISH_STOP)


@torch.no_grad()
def prompt_scores(
    model,
    prompts: Sequence[list[int]],
    *,
    logprobs: bool,
    top_k: int,
    device: torch.device,
    pad_id: int,
    micro_batch_tokens: int,
) -> list[tuple[list[float], list[list[tuple[int, float]]]]]:
    """Per prompt: the log-probability of each token given the ones before it (NaN first; empty
    unless ``logprobs``) and the ``top_k`` most likely ``(token, logprob)`` at each position
    (empty first; empty unless ``top_k``), under ``model`` at temperature 1. Prompts run
    right-padded in passes of at most ``micro_batch_tokens`` padded tokens."""
    if not logprobs and not top_k:
        return [([], []) for _ in prompts]
    out: list[tuple[list[float], list[list[tuple[int, float]]]]] = [([], []) for _ in prompts]
    for rows in _groups([len(p) for p in prompts], micro_batch_tokens, _fits=lambda n: n > 1):
        width = max(len(prompts[i]) for i in rows) - 1
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, i in enumerate(rows):
            ids[r, : len(prompts[i]) - 1] = torch.tensor(prompts[i][:-1], dtype=torch.long)
            mask[r, : len(prompts[i]) - 1] = 1
        logp = torch.log_softmax(
            model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).logits.float(), dim=-1
        )
        for r, i in enumerate(rows):
            n = len(prompts[i]) - 1
            row = logp[r, :n]
            lps, topk = [], []
            if logprobs:
                target = torch.tensor(prompts[i][1:], dtype=torch.long, device=row.device)
                lps = [math.nan] + row.gather(-1, target[:, None])[:, 0].tolist()
            if top_k:
                values, tokens = torch.topk(row, min(top_k, row.shape[-1]), dim=-1)
                topk = [[]] + [list(zip(t, v)) for t, v in zip(tokens.tolist(), values.tolist())]
            out[i] = (lps, topk)
    for i, p in enumerate(prompts):
        if len(p) == 1:
            out[i] = ([math.nan] if logprobs else [], [[]] if top_k else [])
    return out


def _groups(lengths: Sequence[int], budget: int, _fits: Callable[[int], bool]) -> list[list[int]]:
    """Consecutive indices (those ``_fits``) whose padded size stays within ``budget``."""
    groups: list[list[int]] = []
    width = 0
    for i, n in enumerate(lengths):
        if not _fits(n):
            continue
        if groups and (len(groups[-1]) + 1) * max(width, n) <= budget:
            groups[-1].append(i)
            width = max(width, n)
        else:
            groups.append([i])
            width = n
    return groups
