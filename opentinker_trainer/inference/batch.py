"""Continuous batching on the model thread: many requests' rows decode in one forward pass.

A :class:`Member` is one request in the batch: its ``n`` sample rows, its sampling settings, its
own ``torch.Generator`` and its adapter. A :class:`DecodeBatch` holds the rows of its members in
one left-padded key/value cache (``transformers`` ``DynamicCache``, ``[B, heads, W, head_dim]``
per layer) with an attention mask ``[B, W]`` and per-row positions, exactly as the rollout code
runs padded batches (:func:`opentinker_trainer.rl.rollout.position_ids_from_mask`):

* **admit** (:meth:`DecodeBatch.prefill` then :meth:`DecodeBatch.add`): the prompts admitted in
  one step run in one left-padded pass ``[k, P_max]`` (per-row adapters as below), each cache row
  is repeated to its request's ``n`` rows, left-padded (or the batch is) to the common width and
  concatenated on the batch axis;
* **step** (:meth:`DecodeBatch.forward`): ``[B, 1]`` last tokens, mask ``[B, W + 1]``,
  ``position_ids[b]`` = real tokens of row ``b`` so far; rows of different adapters run in the
  same pass (``model_for`` gets each row's adapter name, ``"__base__"`` for base-model rows: the
  runtime groups them by adapter, :mod:`~.lora_rows`, or passes PEFT's ``adapter_names``); with
  prompt-lookup drafts of greedy requests (:mod:`~.prompt_lookup`) the step runs
  ``[B, 1 + longest draft]`` positions, padding masked, and :meth:`DecodeBatch.rewind` masks the
  columns of the draft tokens greedy decoding did not pick;
* **retire** (:meth:`DecodeBatch.remove`): ``batch_select_indices`` keeps the other rows, and
  leading columns that are padding in every remaining row are cut.

Sampling stays per request (:meth:`Member.sample`): the request's logits ``[n, V]`` go through
:func:`~.sampling.select` with the request's generator, so a request draws the same random
numbers in a batch as alone, and the same tokens as ``model.generate`` with that seed. A
request's rows stay until all its ``n`` samples ended (finished rows keep being fed, their
outputs ignored), as ``generate`` does, which keeps the random stream identical.

Why not ``transformers``' own continuous batching (``ContinuousBatchingManager``, installed
5.x): it runs the model from its own background thread on its paged cache with one
``GenerationConfig`` for all requests, so (1) a per-request LoRA adapter cannot be chosen per row
(its batch processor calls the model's forward without PEFT's ``adapter_names``, and adapter
loads could not be ordered with its steps), (2) sampling settings and a seeded
``torch.Generator`` per request are not supported (no seeded parity with ``generate``), (3)
stop strings and our streaming/cancellation would sit on top of its output queue polled from
another thread. Its paged cache is faster on GPUs; on CPU the benchmark compares the two.

Every method here runs on the model thread only; nothing is thread-safe.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from opentinker_trainer.inference.engine import FINISH_LENGTH, FINISH_STOP, SamplingParams, _cache_of
from opentinker_trainer.inference.prefix_cache import PrefixCache
from opentinker_trainer.inference.prompt_lookup import propose
from opentinker_trainer.inference.sampling import raw_logprobs, select

__all__ = ["BASE_ROW", "Member", "DecodeBatch"]

#: PEFT's ``adapter_names`` entry for a row that runs the base model (no LoRA).
BASE_ROW = "__base__"


@dataclass(eq=False)
class Member:
    """One request's rows in a batch.

    Attributes:
        prompt_ids: the prompt's token ids.
        params: its sampling settings (``params.n`` rows).
        adapter: adapter name, ``None`` for the base model.
        stop_ids: token ids that end a sample (empty with ``ignore_eos``).
        tokens, logprobs: per sample, what was chosen so far (a sample's lists stop growing
            when it ends; :attr:`fed` keeps every row's full length for the cache).
        finish: per sample, ``None`` while running, else ``"stop"`` / ``"length"``.
    """

    prompt_ids: list[int]
    params: SamplingParams
    adapter: str | None
    stop_ids: frozenset[int]
    generator: torch.Generator | None = None
    tokens: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    finish: list[str | None] = field(default_factory=list)
    fed: int = 0  # tokens fed per row after the prompt (every row of a member has the same)
    last: list[int] = field(default_factory=list)  # per row, the token to feed on the next step

    @classmethod
    def create(cls, prompt_ids, params: SamplingParams, adapter, stop_token_ids, device) -> "Member":
        gen = None
        if params.temperature > 0:
            gen = torch.Generator(device=device)
            if params.seed is not None:
                gen.manual_seed(int(params.seed))
            else:
                gen.seed()
        n = params.n
        return cls(
            prompt_ids=list(prompt_ids),
            params=params,
            adapter=adapter,
            stop_ids=frozenset() if params.ignore_eos else frozenset(int(i) for i in stop_token_ids),
            generator=gen,
            tokens=[[] for _ in range(n)],
            logprobs=[[] for _ in range(n)],
            finish=[None] * n,
        )

    @property
    def n(self) -> int:
        return self.params.n

    @property
    def done(self) -> bool:
        return all(f is not None for f in self.finish)

    def reserved_tokens(self) -> int:
        """Key/value tokens this request may need at most: ``n * (prompt + max_tokens)``."""
        return self.n * (len(self.prompt_ids) + self.params.max_tokens)

    def finish_sample(self, i: int, reason: str) -> None:
        if self.finish[i] is None:
            self.finish[i] = reason

    def sample(self, logits: torch.Tensor) -> list[tuple[int, int, float, str | None]]:
        """Choose the next token of every row from ``logits [n, V]`` (float32).

        Returns ``(sample index, token, logprob, finish reason or None)`` for each sample that
        was still running."""
        p = self.params
        chosen = select(logits, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, generator=self.generator)
        lps = raw_logprobs(logits, chosen)
        self.last = chosen.tolist()
        self.fed += 1
        out = []
        for i, (tok, lp) in enumerate(zip(self.last, lps.tolist())):
            if self.finish[i] is not None:
                continue
            out.append((i, tok, lp, self._append(i, tok, lp)))
        return out

    def draft(self, max_draft: int) -> list[int]:
        """Prompt-lookup draft of this request's next tokens (:mod:`~.prompt_lookup`): only for
        one greedy sample, and no longer than the tokens ``max_tokens`` leaves after the next one."""
        if self.params.temperature != 0 or self.n != 1 or self.done:
            return []
        room = min(max_draft, self.params.max_tokens - len(self.tokens[0]) - 1)
        return propose([*self.prompt_ids, *self.tokens[0]], room)

    def verify(self, logits: torch.Tensor, draft: list[int]) -> tuple[list[tuple[int, int, float, str | None]], int]:
        """Greedy tokens from the logits ``[1, 1 + len(draft), V]`` of the last token and the draft.

        Position ``j`` gives greedy decoding's token after ``draft[:j]``, so the draft's tokens
        are kept while they equal it, and the token after the last kept one is the model's own:
        ``kept + 1`` tokens, exactly greedy decoding's. A stop token or ``max_tokens`` ends the run.

        Returns the tokens as :meth:`sample` does, in order, and ``kept``, the draft tokens kept."""
        picks = logits[0].argmax(dim=-1)
        chosen = picks.tolist()
        kept = 0
        while kept < len(draft) and draft[kept] == chosen[kept]:
            kept += 1
        run = picks[: kept + 1]
        lps = raw_logprobs(logits[0, : kept + 1], run).tolist()
        self.last = [chosen[kept]]
        self.fed += kept + 1
        out = []
        for tok, lp in zip(chosen[: kept + 1], lps):
            reason = self._append(0, tok, lp)
            out.append((0, tok, lp, reason))
            if reason is not None:
                break
        return out, kept

    def cut(self, i: int, length: int) -> None:
        """End sample ``i`` with ``"stop"`` after its first ``length`` tokens (a stop string ended
        it inside a run of kept draft tokens)."""
        del self.tokens[i][length:], self.logprobs[i][length:]
        self.finish_sample(i, FINISH_STOP)

    def _append(self, i: int, tok: int, lp: float) -> str | None:
        """Add a token to sample ``i``; returns its finish reason, if the token ends it."""
        self.tokens[i].append(tok)
        self.logprobs[i].append(lp)
        reason = None
        if tok in self.stop_ids:
            reason = FINISH_STOP
        elif len(self.tokens[i]) >= self.params.max_tokens:
            reason = FINISH_LENGTH
        if reason is not None:
            self.finish[i] = reason
        return reason


class DecodeBatch:
    """Rows of several requests decoding together in one left-padded key/value cache.

    Args:
        model_for: ``adapter_names or None -> callable model`` (the served model; the PEFT model
            when adapters are loaded).
        cache_kw: the model's key/value-cache argument name (``cache`` or ``past_key_values``).
        device: the model's device.
        prefix: cached prompt prefixes to reuse in :meth:`prefill` (None: every prompt runs whole).
        config: the model's config (builds the key/value cache of a reused prefix).
    """

    def __init__(
        self,
        *,
        model_for,
        cache_kw: str,
        device: torch.device,
        prefix: PrefixCache | None = None,
        config=None,
    ) -> None:
        self.model_for = model_for
        self.prefix = prefix if prefix is not None and prefix.max_blocks else None
        self.config = config
        self.cache_kw = cache_kw
        self.device = device
        self.members: list[Member] = []
        self.cache = None
        self.mask: torch.Tensor | None = None  # [B, W] long, 1 = real token
        # The last forward's width before it and each drafting member's (row, draft length).
        self._drafted: tuple[int, dict[Member, tuple[int, int]]] = (0, {})

    @property
    def rows(self) -> int:
        return sum(m.n for m in self.members)

    @property
    def width(self) -> int:
        return 0 if self.mask is None else int(self.mask.shape[1])

    def _names(self, members) -> list[str] | None:
        return [m.adapter or BASE_ROW for m in members for _ in range(m.n)]

    @torch.inference_mode()
    def prefill(self, members: list[Member]):
        """Run the prompts of ``members`` in one left-padded pass ``[k, S_max]``.

        With a :class:`~.prefix_cache.PrefixCache`, each prompt's longest cached prefix (``L_i``
        tokens on its adapter) is not run again: the pass starts from a cache holding those keys
        and values (left-padded to ``L_max``), and runs only the rest of each prompt (``S_i``
        tokens, left-padded to ``S_max``), at positions ``L_i ..``. A row's columns are then
        ``[pad, prefix, pad, rest]``; the mask marks the padding, positions count real tokens.
        The complete blocks of each prompt are cached for later prompts.

        Returns ``(logits per member [n, V] float32, cache with each member's n rows, mask)``."""
        k = len(members)
        found = [self.prefix.match(m.adapter, m.prompt_ids) if self.prefix else (0, []) for m in members]
        past = max(length for length, _ in found)
        rest = [len(m.prompt_ids) - length for m, (length, _) in zip(members, found)]
        width = max(rest)
        ids = torch.zeros((k, width), dtype=torch.long, device=self.device)
        mask = torch.zeros((k, past + width), dtype=torch.long, device=self.device)
        for r, (m, (length, _)) in enumerate(zip(members, found)):
            s = rest[r]
            ids[r, width - s :] = torch.tensor(m.prompt_ids[length:], dtype=torch.long)
            mask[r, past - length : past] = 1
            mask[r, past + width - s :] = 1
        extra = {}
        if past:
            extra[self.cache_kw] = _cache_from(self.config, found, past)
        model, kw = self.model_for([m.adapter or BASE_ROW for m in members])
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0)[:, past:],
            use_cache=True,
            logits_to_keep=1,
            **extra,
            **kw,
        )
        cache = _cache_of(out)
        if self.prefix is not None:
            layers = _layers(cache)
            for r, (m, (length, _)) in enumerate(zip(members, found)):
                start = past + width - rest[r]  # column of prompt token ``length``
                columns = [-1] * length + list(range(start, start + rest[r]))
                self.prefix.store(m.adapter, m.prompt_ids, layers, r, columns)
        rows = [r for r, m in enumerate(members) for _ in range(m.n)]
        if len(rows) != len(members):
            cache.batch_select_indices(torch.tensor(rows, dtype=torch.long, device=self.device))
        last = out.logits[:, -1, :].float()
        logits = [last[r : r + 1].expand(m.n, -1) for r, m in enumerate(members)]
        return logits, cache, mask[rows]

    def add(self, members: list[Member], cache, mask: torch.Tensor) -> None:
        """Append ``members``' rows (after :meth:`prefill` and their first :meth:`Member.sample`)."""
        if self.cache is None:
            self.cache, self.mask, self.members = cache, mask, list(members)
            return
        w, p = self.width, int(mask.shape[1])
        width = max(w, p)
        for mine, theirs in zip(_layers(self.cache), _layers(cache)):
            for attr in ("keys", "values"):
                a, b = getattr(mine, attr), getattr(theirs, attr)
                setattr(mine, attr, torch.cat([_left_pad(a, width - w), _left_pad(b, width - p)], dim=0))
        self.mask = torch.cat([_left_pad_mask(self.mask, width - w), _left_pad_mask(mask, width - p)], dim=0)
        self.members.extend(members)
        self._trim()

    @torch.inference_mode()
    def forward(self, drafts: dict[Member, list[int]] | None = None) -> list[torch.Tensor]:
        """One decode step of every row; returns each member's logits (float32), in order:
        ``[n, V]``, or ``[1, 1 + len(draft), V]`` for a member with a non-empty draft in ``drafts``.

        With drafts the pass runs ``T = 1 + longest draft`` positions per row: the last token,
        then the row's draft, then masked padding. :meth:`rewind` then drops the draft tokens
        that were not kept."""
        drafts = {m: d for m, d in (drafts or {}).items() if d}
        rows = self.rows
        width = 1 + max((len(d) for d in drafts.values()), default=0)
        ids = torch.zeros((rows, width), dtype=torch.long)
        new = torch.zeros((rows, width), dtype=torch.long)
        new[:, 0] = 1
        ids[:, 0] = torch.tensor([t for m in self.members for t in m.last], dtype=torch.long)
        starts, r = {}, 0
        for m in self.members:
            d = drafts.get(m)
            if d:
                starts[m] = r
                ids[r, 1 : 1 + len(d)] = torch.tensor(d, dtype=torch.long)
                new[r, 1 : 1 + len(d)] = 1
            r += m.n
        ids, new = ids.to(self.device), new.to(self.device)
        # Real tokens so far = the last token's position; the draft follows it.
        positions = self.mask.sum(dim=1, keepdim=True) + torch.arange(width, device=self.device)
        self._drafted = (self.width, {m: (starts[m], len(d)) for m, d in drafts.items()})
        self.mask = torch.cat([self.mask, new], dim=1)
        model, kw = self.model_for(self._names(self.members))
        out = model(
            input_ids=ids,
            attention_mask=self.mask,
            position_ids=positions,
            use_cache=True,
            **{self.cache_kw: self.cache},
            **kw,
        )
        self.cache = _cache_of(out)
        logits = out.logits.float()
        result, r = [], 0
        for m in self.members:
            d = drafts.get(m)
            result.append(logits[r : r + 1, : 1 + len(d)] if d else logits[r : r + m.n, 0])
            r += m.n
        return result

    @torch.inference_mode()
    def rewind(self, kept: dict[Member, int]) -> None:
        """After a :meth:`forward` with drafts: mask out the key/value columns of each member's
        draft tokens past its ``kept`` first ones, and cut the columns no row uses at the end."""
        start, drafted = self._drafted
        self._drafted = (0, {})
        for m, (row, length) in drafted.items():
            self.mask[row, start + 1 + kept.get(m, 0) : start + 1 + length] = 0
        if not drafted:
            return
        used = self.mask.any(dim=0).nonzero()
        end = int(used[-1]) + 1 if len(used) else 0
        if end < self.width:
            self.mask = self.mask[:, :end]
            for layer in _layers(self.cache):
                layer.keys = layer.keys[:, :, :end]
                layer.values = layer.values[:, :, :end]

    def remove(self, gone: set[Member]) -> None:
        """Drop the rows of members in ``gone`` and the padding columns no remaining row needs."""
        if not any(m in gone for m in self.members):
            return
        keep_members = [m for m in self.members if m not in gone]
        if not keep_members:
            self.members, self.cache, self.mask = [], None, None
            return
        keep, start = [], 0
        for m in self.members:
            if m not in gone:
                keep.extend(range(start, start + m.n))
            start += m.n
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.cache.batch_select_indices(idx)
        self.mask = self.mask.index_select(0, idx)
        self.members = keep_members
        self._trim()

    def _trim(self) -> None:
        pad = int((self.mask.cumsum(dim=1) == 0).sum(dim=1).min())  # leading padding shared by every row
        if pad:
            self.mask = self.mask[:, pad:]
            for layer in _layers(self.cache):
                layer.keys = layer.keys[:, :, pad:]
                layer.values = layer.values[:, :, pad:]


def _layers(cache):
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(f"{type(cache).__name__}: continuous batching needs a transformers Cache with .layers")
    return layers


def _cache_from(config, found, past: int):
    """A ``DynamicCache`` of ``past`` columns: row ``r`` holds ``found[r]``'s reused keys and
    values (``(L, per layer (keys, values) [heads, L, head_dim])``) left-padded with zeros."""
    from transformers import DynamicCache

    ref = next(kv for length, kv in found if length)
    cache = DynamicCache(config=config)
    for i, (ref_k, ref_v) in enumerate(ref):
        rows_k, rows_v = [], []
        for length, kv in found:
            if length:
                rows_k.append(_left_pad(kv[i][0].unsqueeze(0), past - length))
                rows_v.append(_left_pad(kv[i][1].unsqueeze(0), past - length))
            else:
                rows_k.append(ref_k.new_zeros((1, ref_k.shape[0], past, ref_k.shape[2])))
                rows_v.append(ref_v.new_zeros((1, ref_v.shape[0], past, ref_v.shape[2])))
        cache.update(torch.cat(rows_k), torch.cat(rows_v), i)
    return cache


def _left_pad(t: torch.Tensor, k: int) -> torch.Tensor:
    """``[B, H, T, D]`` -> ``[B, H, k + T, D]`` with zeros first."""
    if k == 0:
        return t
    return torch.cat([t.new_zeros((*t.shape[:2], k, t.shape[3])), t], dim=2)


def _left_pad_mask(mask: torch.Tensor, k: int) -> torch.Tensor:
    if k == 0:
        return mask
    return torch.cat([mask.new_zeros((mask.shape[0], k)), mask], dim=1)
