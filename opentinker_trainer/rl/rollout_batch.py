"""Rollouts of several LoRA adapters in one forward pass per token: a model host's tenants.

Each :class:`RolloutRequest` is one tenant's :func:`~opentinker_trainer.rl.rollout.generate`
call (its prompts, group size, sampling settings and stop tokens, the PEFT adapter its rows use
and the state of the torch generator its draws come from). :func:`generate_batched` samples all
of them together and returns, per request, the :class:`~opentinker_trainer.rl.rollout.Rollout`
that ``generate`` would return for it alone (tokens equal up to float rounding of the batched
forward, see below) and its generator's state after its draws.

Layout: the distinct prompts of every request run in one left-padded prefill pass ``[sum G, P]``
and each prompt's key/value cache is repeated to its ``group_size`` rows; then one decode pass
``[B, 1]`` per token over the rows of every request still sampling, padding-aware (attention mask
and position ids from lengths, as in :mod:`~opentinker_trainer.rl.rollout`), in the inference
engine's left-padded cache (:class:`opentinker_trainer.inference.batch.DecodeBatch`). Every row
runs its own adapter in the same pass: grouped by adapter (Punica / S-LoRA style,
:class:`opentinker_trainer.inference.lora_rows.RowLoRA`, over copies of the adapters' weights),
or PEFT's per-row ``adapter_names`` where the adapters cannot run grouped
(:func:`~opentinker_trainer.inference.lora_rows.supports`). The model runs in eval mode (no
dropout), as ``generate`` is called.

Why a request's tokens are those of ``generate`` alone (``transformers`` 5.x ``_sample``, CPU and
CUDA; not MPS, where it defers its stop check and draws once more): ``generate`` draws, once per
step, ``torch.multinomial(softmax(processed float32 logits), 1)`` over all its ``[B_t, V]`` rows,
finished rows included (their token then replaced by the pad token), until every row has stopped
or ``max_new_tokens`` steps were taken. ``multinomial`` with one sample draws one exponential per
element of the ``[B_t, V]`` tensor (``q ~ Exp(1)``, ``argmax(p / q)``), so what it consumes of the
generator depends on the shape alone, and a row's choice on its own probabilities and its own
slice of the draws. Here every request draws exactly so: per step, over its own ``[B_t, V]`` rows
(:func:`opentinker_trainer.inference.sampling.select`: the same temperature warper, top-p and
softmax in float32), from its own ``torch.Generator`` started in the state ``generate`` would have
found the global generator in, until its own rows have all stopped or its own
``max_new_tokens`` is reached; then its rows leave the batch. The only difference is float
rounding: a row's logits come from a pass with other rows, other padding widths and the grouped
LoRA product, equal to its solo logits within float tolerance, which moves a draw only when it
falls within that tolerance of a boundary between two tokens (none seen on the test models).
Logits processors a model's ``generation_config`` may add (suppressed tokens, bad words,
``min_length`` ...) are not applied here: :func:`unbatchable` says when a model has any, and the
caller then keeps ``generate``.

A request alone runs ``generate`` itself, with the global torch generator set to its state for
the call (:func:`generate_alone`): the same numbers as a worker process, bit for bit.

Failures stay with their request: a request whose draw fails (its adapter's logits are NaN: a
diverged tenant) gets that error and its rows leave the batch; a pass that fails for the whole
batch (out of memory) is retried request by request alone, so each gets its own outcome.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Sequence

import torch

from opentinker_trainer.inference.batch import BASE_ROW, DecodeBatch, Member
from opentinker_trainer.inference.engine import SamplingParams, cache_kwarg
from opentinker_trainer.inference.lora_rows import RowLoRA, supports
from opentinker_trainer.inference.sampling import select
from opentinker_trainer.rl.rollout import Rollout, generate, rollout_of

__all__ = [
    "RolloutRequest",
    "RolloutOutcome",
    "generate_batched",
    "generate_alone",
    "rng_state",
    "set_rng_state",
    "unbatchable",
]


@dataclass(eq=False)
class RolloutRequest:
    """One tenant's :func:`~opentinker_trainer.rl.rollout.generate` call.

    Attributes:
        adapter: the PEFT adapter name its rows use (``None``: the base model, LoRA off).
        prompt_ids, prompt_mask: ``[G, P]`` distinct prompts, left-padded (mask bool).
        max_new_tokens, stop_token_ids, pad_token_id, temperature, top_p, group_size: as
            ``generate`` takes them (``G * group_size`` rows, prompt ``g`` in rows
            ``g * group_size .. (g + 1) * group_size - 1``).
        rng_state: the state of the torch generator on the model's device (``torch.get_rng_state()``
            on the CPU, ``torch.cuda.get_rng_state(device)`` on a GPU) its draws start from.
    """

    adapter: str | None
    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    max_new_tokens: int
    stop_token_ids: Sequence[int]
    pad_token_id: int
    rng_state: torch.Tensor
    temperature: float = 1.0
    top_p: float = 1.0
    group_size: int = 1


@dataclass
class RolloutOutcome:
    """What one request got: its ``rollout`` and the generator state after its draws
    (``rng_state``), or the ``error`` that ended it (both others None)."""

    rollout: Rollout | None = None
    rng_state: torch.Tensor | None = None
    error: BaseException | None = None


def rng_state(device: torch.device) -> torch.Tensor:
    """The global torch generator's state on ``device`` (CPU, or that CUDA device's)."""
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def set_rng_state(state: torch.Tensor, device: torch.device) -> None:
    """Inverse of :func:`rng_state`."""
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


#: ``generation_config`` fields that make ``generate`` add a logits processor or a stopping
#: criterion :func:`generate_batched` does not apply, with their neutral values (``transformers``
#: 5.x ``GenerationMixin._get_logits_processor`` / ``_get_stopping_criteria``; ``top_k``,
#: ``repetition_penalty``, ``no_repeat_ngram_size`` and ``min_new_tokens`` the rollout sets itself).
_NEUTRAL: dict[str, tuple] = {
    "guidance_scale": (None, 1, 1.0),
    "sequence_bias": (None,),
    "encoder_repetition_penalty": (None, 1.0),
    "encoder_no_repeat_ngram_size": (None, 0),
    "bad_words_ids": (None,),
    "min_length": (None, 0),
    "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,),
    "remove_invalid_values": (None, False),
    "exponential_decay_length_penalty": (None,),
    "suppress_tokens": (None,),
    "begin_suppress_tokens": (None,),
    "top_h": (None,),
    "min_p": (None,),
    "typical_p": (None, 1.0),
    "epsilon_cutoff": (None, 0.0),
    "eta_cutoff": (None, 0.0),
    "watermarking_config": (None,),
    "renormalize_logits": (None, False),
    "max_time": (None,),
    "stop_strings": (None,),
}


def unbatchable(model) -> str | None:
    """Why :func:`generate_batched` would not sample what ``generate`` samples on ``model``: the
    first ``generation_config`` field set to a non-neutral value (see :data:`_NEUTRAL`), or an MPS
    device (``generate`` draws once more there); None when it would."""
    param = next(model.parameters(), None)
    if param is not None and param.device.type == "mps":
        return "an MPS device: generate defers its stop check and draws once more"
    config = getattr(model, "generation_config", None)
    for name, neutral in _NEUTRAL.items():
        value = getattr(config, name, None)
        if value not in neutral and value != []:
            return f"generation_config.{name} = {value!r}"
    return None


def generate_alone(model, request: RolloutRequest) -> RolloutOutcome:
    """``request`` by :func:`~opentinker_trainer.rl.rollout.generate` itself with its adapter
    active (``None``: adapter layers off), its draws from the global torch generator set to
    ``request.rng_state`` for the call: a worker's numbers exactly. The global generator and the
    active adapter are restored after; errors are returned, not raised."""
    device = request.prompt_ids.device
    saved = rng_state(device)
    active = getattr(model, "active_adapter", None)
    off = model.disable_adapter() if request.adapter is None else contextlib.nullcontext()
    try:
        if request.adapter is not None and request.adapter != active:
            model.set_adapter(request.adapter)
        set_rng_state(request.rng_state, device)
        with off:
            ro = generate(
                model,
                request.prompt_ids,
                request.prompt_mask,
                max_new_tokens=request.max_new_tokens,
                stop_token_ids=request.stop_token_ids,
                pad_token_id=request.pad_token_id,
                temperature=request.temperature,
                top_p=request.top_p,
                group_size=request.group_size,
            )
        return RolloutOutcome(rollout=ro, rng_state=rng_state(device))
    except Exception as exc:  # noqa: BLE001 - one request's failure is its own outcome
        return RolloutOutcome(error=exc)
    finally:
        set_rng_state(saved, device)
        if active != getattr(model, "active_adapter", None) and active in getattr(model, "peft_config", {}):
            model.set_adapter(active)


def generate_batched(peft_model, requests: Sequence[RolloutRequest], *, grouped: bool = True) -> list[RolloutOutcome]:
    """Sample every request's rollout in shared forward passes (see the module docstring).

    Args:
        peft_model: the ``PeftModel`` holding every request's adapter; every pass runs in eval
            mode (no dropout: how the trainers call ``generate``), and its mode, active adapter
            and adapter layers are as before on return.
        requests: the rollouts to sample; one alone runs :func:`generate_alone`.
        grouped: rows grouped by adapter (:class:`~opentinker_trainer.inference.lora_rows.RowLoRA`)
            where every adapter supports it; ``False``: PEFT's per-row ``adapter_names``.

    Returns:
        One outcome per request, in order. Never raises for a request's failure: see the module
        docstring for which failures end one request and which are retried alone.
    """
    was_training = peft_model.training
    peft_model.eval()  # whatever mode another tenant's update left it in: no dropout
    try:
        if len(requests) == 1:
            return [generate_alone(peft_model, requests[0])]
        outcomes: list[RolloutOutcome | None] = [None] * len(requests)
        try:
            _decode(peft_model, requests, outcomes, grouped)
        except Exception:  # noqa: BLE001 - the whole pass failed: each request again, alone
            for i, req in enumerate(requests):
                if outcomes[i] is None:
                    outcomes[i] = generate_alone(peft_model, req)
        return [o if o is not None else RolloutOutcome(error=RuntimeError("rollout not run")) for o in outcomes]
    finally:
        peft_model.train(was_training)


@dataclass(eq=False)
class _Job:
    """One request while it samples: its members (one per distinct prompt, ``group_size`` rows
    each) in the decode batch, its generator, and the tokens drawn per step ``[B_t]``."""

    request: RolloutRequest
    members: list[Member]
    generator: torch.Generator
    stops: torch.Tensor
    unfinished: torch.Tensor  # [B_t] bool
    columns: list[torch.Tensor] = field(default_factory=list)

    def draw(self, logits: torch.Tensor) -> bool:
        """One step of ``generate``'s sampling loop on this request's logits ``[B_t, V]``
        (float32): returns True when the request is done (all rows stopped, or ``max_new_tokens``)."""
        req = self.request
        chosen = select(logits, temperature=req.temperature, top_k=0, top_p=req.top_p, generator=self.generator)
        chosen = torch.where(self.unfinished, chosen, torch.full_like(chosen, req.pad_token_id))
        self.columns.append(chosen)
        self.unfinished = self.unfinished & ~torch.isin(chosen, self.stops)
        if not bool(self.unfinished.any()) or len(self.columns) >= req.max_new_tokens:
            return True
        k = req.group_size
        for g, member in enumerate(self.members):
            member.last = chosen[g * k : (g + 1) * k].tolist()
        return False

    def outcome(self) -> RolloutOutcome:
        req = self.request
        k = req.group_size
        sampled = torch.stack(self.columns, dim=1).clone()  # [B_t, T]; an ordinary tensor
        ro = rollout_of(
            req.prompt_ids.repeat_interleave(k, dim=0),
            req.prompt_mask.repeat_interleave(k, dim=0),
            sampled,
            req.stop_token_ids,
            req.pad_token_id,
        )
        return RolloutOutcome(rollout=ro, rng_state=self.generator.get_state())


def _decode(peft_model, requests: Sequence[RolloutRequest], outcomes: list, grouped: bool) -> None:
    """The batched loop; fills ``outcomes[i]`` as request ``i`` ends (an error or its rollout)."""
    base = peft_model.get_base_model()
    device = requests[0].prompt_ids.device
    rows = None
    if grouped and supports(peft_model):
        names = sorted({r.adapter for r in requests if r.adapter is not None})
        rows = RowLoRA(peft_model, names, alias=False) if names else None

    def model_for(names):
        if rows is not None:
            rows.set_rows([None if n == BASE_ROW else n for n in names])
            return base, {}
        return peft_model, {"adapter_names": list(names)}

    jobs: list[_Job] = []
    for req in requests:
        gen = torch.Generator(device=device)
        gen.set_state(req.rng_state)
        params = SamplingParams(
            temperature=req.temperature, top_p=req.top_p, max_tokens=req.max_new_tokens, n=req.group_size
        )
        members = [
            Member(
                prompt_ids=ids[mask].tolist(),
                params=params,
                adapter=req.adapter,
                stop_ids=frozenset(int(t) for t in req.stop_token_ids),
            )
            for ids, mask in zip(req.prompt_ids, req.prompt_mask.bool())
        ]
        stops = torch.as_tensor(sorted(set(int(t) for t in req.stop_token_ids)), dtype=torch.long, device=device)
        unfinished = torch.ones(len(members) * req.group_size, dtype=torch.bool, device=device)
        jobs.append(_Job(req, members, gen, stops, unfinished))
    index = {id(job): i for i, job in enumerate(jobs)}

    if rows is not None:
        peft_model.base_model.disable_adapter_layers()
    try:
        batch = DecodeBatch(model_for=model_for, cache_kw=cache_kwarg(peft_model), device=device)
        every = [m for job in jobs for m in job.members]
        logits, cache, mask = batch.prefill(every)
        batch.add(every, cache, mask)
        by_member = dict(zip(map(id, every), logits))
        active = list(jobs)
        while active:
            gone: set[Member] = set()
            still = []
            for job in active:
                try:
                    done = job.draw(torch.cat([by_member[id(m)] for m in job.members]))
                    if done:
                        outcomes[index[id(job)]] = job.outcome()
                except Exception as exc:  # noqa: BLE001 - this request's draw failed (NaN logits): its own outcome
                    outcomes[index[id(job)]] = RolloutOutcome(error=exc)
                    done = True
                if done:
                    gone.update(job.members)
                else:
                    still.append(job)
            active = still
            if not active:
                break
            batch.remove(gone)
            by_member = dict(zip(map(id, batch.members), batch.forward()))
    finally:
        if rows is not None:
            rows.close()
            peft_model.base_model.enable_adapter_layers()
