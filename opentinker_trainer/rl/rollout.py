"""Rollouts for a causal LM: batching, sampling and per-token log-probabilities.

Layout of a batch of ``B`` sequences (``P`` prompt columns, ``T`` completion columns)::

    [pad pad p0 p1 p2 | c0 c1 EOS pad pad]     prompt padded on the LEFT,
    [p0 p1 p2 p3 p4   | c0 c1 c2  c3  c4 ]     completion padded on the RIGHT

* ``attention_mask`` is 1 on real prompt tokens and on completion tokens up to and including the
  first stop token; ``position_ids`` count real tokens only (``cumsum(mask) - 1``), so every real
  token sees exactly the keys and positions it would see if its sample were alone. Hence a
  sample's log-probs (and its reward) do not depend on what it was batched with.
* A group of ``K`` completions of one prompt shares the prompt's forward pass: the prompt is
  run once, its key/value cache repeated ``K`` times, and only the completions are run per sample
  (:func:`generate` and :func:`sequence_logprobs` with ``group_size``). Gradients flow through
  the shared cache, so this is exact, and with prompts much longer than completions it is several
  times cheaper than running ``K`` copies of each prompt.
* Masks always come from lengths, never from ``ids != pad_token_id``: many chat models (SmolLM2,
  Qwen) use their end-of-turn token as pad, and it also occurs inside prompts.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from opentinker_trainer.rl.grpo import token_logprobs

__all__ = [
    "Rollout",
    "completion_mask",
    "generate",
    "left_pad",
    "position_ids_from_mask",
    "prefix_logprobs",
    "right_pad",
    "rollout_of",
    "sequence_logprobs",
    "shared_prompts",
]


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack token lists padded on the left: ``(ids [B, L], mask [B, L] bool)``."""
    return _pad(sequences, pad_id, device, left=True)


def right_pad(sequences: Sequence[Sequence[int]], pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack token lists padded on the right: ``(ids [B, L], mask [B, L] bool)``."""
    return _pad(sequences, pad_id, device, left=False)


def _pad(sequences: Sequence[Sequence[int]], pad_id: int, device, *, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    width = max((len(s) for s in sequences), default=0)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.bool)
    for i, seq in enumerate(sequences):
        if len(seq):
            cols = slice(width - len(seq), width) if left else slice(0, len(seq))
            ids[i, cols] = torch.as_tensor(list(seq), dtype=torch.long)
            mask[i, cols] = True
    return ids.to(device), mask.to(device)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` positions counting real tokens from 0 (padding gets 0; it is masked anyway)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def completion_mask(completion_ids: torch.Tensor, stop_token_ids: Iterable[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask of a right-padded completion: everything up to and including the first stop token.

    Args:
        completion_ids: ``[B, T]`` sampled tokens (whatever ``generate`` put after a stop token).
        stop_token_ids: ids that end a completion (EOS, end-of-turn).

    Returns:
        ``(mask [B, T] bool, lengths [B] long)``; a completion with no stop token is ``T`` long
        (truncated at ``max_new_tokens``).
    """
    b, t = completion_ids.shape
    stops = torch.as_tensor(sorted(set(stop_token_ids)), dtype=completion_ids.dtype, device=completion_ids.device)
    is_stop = torch.isin(completion_ids, stops)
    has_stop = is_stop.any(dim=1)
    first_stop = torch.where(has_stop, is_stop.int().argmax(dim=1), torch.full_like(has_stop, t, dtype=torch.long))
    lengths = torch.where(has_stop, first_stop + 1, first_stop).long()
    mask = torch.arange(t, device=completion_ids.device).unsqueeze(0) < lengths.unsqueeze(1)
    return mask, lengths


@dataclass
class Rollout:
    """A batch of prompts (left-padded) and their sampled completions (right-padded).

    Attributes:
        prompt_ids, prompt_mask: ``[B, P]``.
        completion_ids, completion_mask: ``[B, T]``; the mask covers the first stop token.
        completion_lengths: ``[B]``.
        truncated: ``[B]`` bool, true where no stop token came within ``max_new_tokens``.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    completion_lengths: torch.Tensor
    truncated: torch.Tensor

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    def select(self, index: slice | torch.Tensor) -> "Rollout":
        """Rows ``index`` (for micro-batches)."""
        return Rollout(*(getattr(self, f)[index] for f in self.__dataclass_fields__))

    def completion_token_lists(self) -> list[list[int]]:
        """Each completion's real tokens (stop token included), for decoding."""
        return [row[:n].tolist() for row, n in zip(self.completion_ids, self.completion_lengths.tolist())]


def _unwrap(model):
    """The transformers model under a PEFT wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _cache_kwarg(model) -> str:
    """Name of the KV-cache argument of ``forward`` and ``generate``: ``cache`` (newer
    transformers) or ``past_key_values`` (older)."""
    fn = type(_unwrap(model)).forward
    return "cache" if "cache" in inspect.signature(fn).parameters else "past_key_values"


def shared_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, group_size: int):
    """``(ids [G, P], mask [G, P])`` when rows come in groups of ``group_size`` identical prompts,
    else None: each prompt once, for a pass that runs it once for its group."""
    b = prompt_ids.shape[0]
    if group_size <= 1 or b % group_size or prompt_ids.shape[1] < 2:
        return None
    ids = prompt_ids.view(b // group_size, group_size, -1)
    mask = prompt_mask.view(b // group_size, group_size, -1)
    if not (torch.equal(ids, ids[:, :1].expand_as(ids)) and torch.equal(mask, mask[:, :1].expand_as(mask))):
        return None
    return ids[:, 0], mask[:, 0]


def _prefix_forward(model, ids: torch.Tensor, mask: torch.Tensor, **extra):
    """One forward of left-padded prefixes ``[N, P]`` that keeps their cache and last logits."""
    return model(
        input_ids=ids,
        attention_mask=mask.long(),
        position_ids=position_ids_from_mask(mask),
        use_cache=True,
        logits_to_keep=1,
        **extra,
    )


def _prompt_cache(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, rows: int | torch.Tensor, out=None):
    """Run prompts ``[N, P]`` once; return ``(last logits [N, 1, V], cache expanded to the rows)``.

    ``rows``: an int ``K`` (the cache is repeated ``K`` times per prompt, ``batch_repeat_interleave``)
    or ``[B]`` long prompt indices (``batch_select_indices``). Returns None when the model's cache
    cannot be expanded so (then run flat). ``out``: a forward of the prompts already run (with
    ``use_cache``), to take its cache.
    """
    if out is None:
        out = _prefix_forward(model, prompt_ids, prompt_mask)
    cache = _model_cache(out)
    expand = "batch_repeat_interleave" if isinstance(rows, int) else "batch_select_indices"
    if cache is None or not hasattr(cache, expand):
        return None
    getattr(cache, expand)(rows)
    return out.logits[:, -1:, :], cache


#: Config keys of models whose logits are not the output projection of the last hidden states.
_SCALED_LOGITS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def _scored_prefix(model, prefix_ids: torch.Tensor, prefix_mask: torch.Tensor):
    """Run prefixes ``[N, P]`` once, keeping the last hidden states: ``(forward output, [N, P - 1]
    log-probs of ``prefix_ids[:, 1:]`` without gradient, or None)``. The log-probs come from the
    model's output projection on the hidden states; None when that does not give the model's
    logits (a model that scales or caps its logits after the projection)."""
    out = _prefix_forward(model, prefix_ids, prefix_mask, output_hidden_states=True)
    head = None
    hidden = out.hidden_states[-1] if out.hidden_states else None
    project = model.get_output_embeddings()
    config = getattr(model, "config", None)
    if any(getattr(config, k, None) for k in _SCALED_LOGITS):
        project = None  # the check below cannot see a small logit's softcap or scale
    if hidden is not None and project is not None:
        with torch.no_grad():
            logits = project(hidden.detach())
            if torch.allclose(logits[:, -1:, :].float(), out.logits[:, -1:, :].detach().float(), atol=1e-4, rtol=1e-4):
                head = token_logprobs(logits[:, :-1, :], prefix_ids[:, 1:])
    return out, head


def _model_cache(out):
    """The key/value cache of a forward's output (``cache`` in newer transformers, else ``past_key_values``)."""
    return out.get("cache", None) if "cache" in type(out).__dataclass_fields__ else out.past_key_values


def prefix_logprobs(
    model,
    prefix_ids: torch.Tensor,
    prefix_mask: torch.Tensor,
    rows: int | torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    *,
    prefix_scores: bool = False,
):
    """Log-probs of completions that follow shared prefixes, each prefix run once: ``[B, T]`` float32.

    The prefixes are run once with a key/value cache; the cache (and the logits of each prefix's
    last token, which predict the first completion token) are then expanded to the ``B``
    completion rows, and the completions run on top with padding-aware positions (see the module
    docstring). Gradients flow through the shared cache, so values and gradients equal a flat
    forward of every (prefix, completion) row, up to float rounding.

    Args:
        prefix_ids, prefix_mask: ``[N, P]`` distinct prefixes, left-padded.
        rows: which prefix each completion row follows: an int ``K`` for ``K`` consecutive rows
            per prefix (``B = N * K``; the cache is ``batch_repeat_interleave``'d), or ``[B]``
            long indices into the prefixes (the cache is ``batch_select_indices``'d).
        completion_ids, completion_mask: ``[B, T]`` right-padded completions.
        temperature: log-probs under ``softmax(logits / temperature)``; a ``[B, 1, 1]`` tensor
            gives each row its own.

        prefix_scores: also give each prefix token's log-prob given the tokens before it, from
            the same prefix pass, without gradient (see :func:`_scored_prefix`).

    Returns:
        ``[B, T]`` token log-probs (meaningless at masked positions); with ``prefix_scores`` the
        pair of those and the ``[N, P - 1]`` prefix log-probs (column ``j`` scores
        ``prefix_ids[:, j + 1]``; meaningless where the mask is 0; None when the model's output
        projection does not give its logits). None when the model's cache cannot be expanded
        along the batch (then run the rows flat).
    """
    out = head = None
    if prefix_scores:
        out, head = _scored_prefix(model, prefix_ids, prefix_mask)
    shared = _prompt_cache(model, prefix_ids, prefix_mask, rows, out)
    if shared is None:
        return None
    last, cache = shared  # last: [N, 1, V]
    if isinstance(rows, int):
        logits, row_mask = last.repeat_interleave(rows, dim=0), prefix_mask.repeat_interleave(rows, dim=0)
    else:
        logits, row_mask = last.index_select(0, rows), prefix_mask.index_select(0, rows)
    t = completion_ids.shape[1]
    if t > 1:
        full_mask = torch.cat([row_mask, completion_mask], dim=1)
        positions = position_ids_from_mask(full_mask)
        p = prefix_ids.shape[1]
        rest = model(
            input_ids=completion_ids[:, :-1],
            attention_mask=full_mask[:, :-1].long(),
            position_ids=positions[:, p:-1],
            use_cache=True,
            **{_cache_kwarg(model): cache},
        )
        logits = torch.cat([logits, rest.logits], dim=1)
    if isinstance(temperature, torch.Tensor) or temperature != 1.0:
        logits = logits.float() / temperature
    scores = token_logprobs(logits, completion_ids)
    return (scores, head) if prefix_scores else scores


@torch.no_grad()
def generate(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    pad_token_id: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    group_size: int = 1,
    seed: int | None = None,
    synced: bool = False,
) -> Rollout:
    """Sample ``group_size`` completions of each (left-padded) prompt with ``model.generate``.

    Args:
        prompt_ids, prompt_mask: ``[G, P]`` distinct prompts, padded on the left.
        group_size: completions per prompt; the returned rollout has ``G * group_size`` rows,
            prompt ``g`` in rows ``g * group_size ... (g + 1) * group_size - 1``. The prompts are
            prefilled once and their cache shared by the group.

    Pure ancestral sampling from ``softmax(logits / temperature)``, nucleus-truncated by ``top_p``;
    ``top_k`` and repetition penalties that a model's ``generation_config`` may carry (Qwen's do)
    are switched off, so the sampler is the policy whose log-probs :func:`sequence_logprobs`
    computes — exactly so only when ``top_p == 1``: a nucleus sampler draws from the truncated,
    renormalised softmax, which is not that policy, so the GRPO trainers' specs refuse
    ``top_p < 1`` (:func:`opentinker_common.spec.lm_fields.check_rollout_top_p`).

    Randomness comes from torch's global generator (``generate`` takes no ``torch.Generator``);
    ``seed`` re-seeds it first (``torch.manual_seed``, which seeds CUDA too).

    ``synced``: the model is sharded over ranks (FSDP, every forward a collective), so every rank
    must take as many forwards: ``generate`` runs with ``synced_gpus`` (a rank that has finished
    keeps stepping until all have) and the prompts are not prefilled separately (the number of
    forwards must not depend on this rank's prompt length). The completions' width ``T`` still
    differs by rank: :func:`pad_completions` evens it out.
    """
    if seed is not None:
        torch.manual_seed(seed)
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    extra = {}
    if group_size > 1 and prompt_ids.shape[1] >= 2 and not synced:
        # Prefill all but the last prompt token once per prompt; generate() runs the rest.
        shared = _prompt_cache(model, prompt_ids[:, :-1], prompt_mask[:, :-1], group_size)
        if shared is not None:
            extra[_cache_kwarg(model)] = shared[1]
    prompt_ids = prompt_ids.repeat_interleave(group_size, dim=0)
    prompt_mask = prompt_mask.repeat_interleave(group_size, dim=0)
    out = model.generate(
        input_ids=prompt_ids,
        attention_mask=prompt_mask.long(),
        do_sample=True,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=0,
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        max_new_tokens=int(max_new_tokens),
        min_new_tokens=0,
        eos_token_id=list(stop_token_ids),
        pad_token_id=int(pad_token_id),
        **({"synced_gpus": True} if synced else {}),
        **extra,
    )
    return rollout_of(prompt_ids, prompt_mask, out[:, prompt_ids.shape[1] :], stop_token_ids, pad_token_id)


def rollout_of(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    sampled: torch.Tensor,
    stop_token_ids: Sequence[int],
    pad_token_id: int,
) -> Rollout:
    """The :class:`Rollout` of rows ``[B, P]`` (left-padded prompts, each row's own) and the tokens
    sampled after them, ``sampled [B, T]`` (whatever came after a row's first stop token is
    replaced by ``pad_token_id`` and masked out)."""
    mask, lengths = completion_mask(sampled, stop_token_ids)
    completion_ids = torch.where(mask, sampled, torch.full_like(sampled, pad_token_id))
    stops = torch.as_tensor(sorted(set(stop_token_ids)), dtype=completion_ids.dtype, device=completion_ids.device)
    truncated = ~torch.isin(completion_ids, stops).any(dim=1)
    return Rollout(prompt_ids, prompt_mask, completion_ids, mask, lengths, truncated)


def pad_completions(ro: Rollout, width: int, pad_token_id: int) -> Rollout:
    """``ro`` with its completions right-padded (masked out) to ``width`` tokens (``>= T``), so
    that ranks of a sharded model run forwards of the same shapes (:func:`generate`'s ``synced``)."""
    extra = width - ro.completion_ids.shape[1]
    if extra <= 0:
        return ro
    ids = torch.nn.functional.pad(ro.completion_ids, (0, extra), value=pad_token_id)
    mask = torch.nn.functional.pad(ro.completion_mask, (0, extra), value=False)
    return Rollout(ro.prompt_ids, ro.prompt_mask, ids, mask, ro.completion_lengths, ro.truncated)


def sequence_logprobs(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float = 1.0,
    group_size: int = 1,
) -> torch.Tensor:
    """Log-prob of each completion token under ``softmax(logits / temperature)``: ``[B, T]`` float32.

    Args:
        prompt_ids, prompt_mask: ``[B, P]`` left-padded prompts.
        completion_ids, completion_mask: ``[B, T]`` right-padded completions.
        temperature: the sampling temperature. Dividing by it makes these the log-probs of the
            distribution that sampled (as TRL and verl do), so that importance ratios start at 1.
        group_size: when rows come in groups of this many identical prompts (as
            :func:`generate` returns them), each prompt is run once and its cache shared. Any
            other layout silently takes the flat path; both give the same values.

    Padding-aware attention mask and position ids (see the module docstring) make each row's
    values independent of the rest of the batch. Values at masked completion positions are
    meaningless; mask them. Gradients flow when called with grad enabled.
    """
    shared = shared_prompts(prompt_ids, prompt_mask, group_size)
    if shared is not None:
        logp = prefix_logprobs(model, *shared, group_size, completion_ids, completion_mask, temperature)
        if logp is not None:
            return logp
    # The last completion token predicts nothing we score: drop it, keep only T logits.
    t = completion_ids.shape[1]
    full_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    out = model(
        input_ids=input_ids[:, :-1],
        attention_mask=full_mask[:, :-1].long(),
        position_ids=position_ids_from_mask(full_mask)[:, :-1],
        use_cache=False,
        logits_to_keep=t,
    )
    logits = out.logits[:, -t:, :]
    if temperature != 1.0:
        logits = logits.float() / temperature
    return token_logprobs(logits, completion_ids)
