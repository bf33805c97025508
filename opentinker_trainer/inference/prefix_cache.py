"""Key/value blocks of prompt prefixes already prefilled, reused by later prompts (prefix caching).

A prompt's first tokens are often the same from one request to the next (a chat template's system
prompt, a few-shot preamble, ``n`` samples asked again). Their keys and values depend only on
those tokens, their positions (``0 .. L-1``, the rotary embedding is already applied) and the
weights that ran them (the base model and the request's adapter), so a later prompt starting
with the same tokens on the same adapter can skip them and prefill only the rest
(:meth:`~.batch.DecodeBatch.prefill`). This is vLLM's automatic prefix caching, SGLang's
RadixAttention and ``transformers``' own continuous batching's block sharing
(``ContinuousBatchingConfig.allow_block_sharing``, on by default), here on the dense key/value
layout of :mod:`~.batch`:

* the unit is a **block** of ``block`` consecutive prompt tokens (only complete blocks are kept);
  a block is a node of a tree per adapter: its key is (adapter, parent block, its tokens), so a
  block matches only after the same tokens before it, and the match compares the tokens
  themselves (no hash collisions);
* **match** (:meth:`PrefixCache.match`): the longest chain of cached blocks that leaves at least
  one prompt token to run (the last token's logits are needed), as ``transformers``' allocator
  matches ``(len - 1) // page_size`` blocks;
* **store** (:meth:`PrefixCache.store`): after a prefill, the complete blocks of each prompt not
  cached yet are copied out of the batch's cache (one ``[heads, block, head_dim]`` key and value
  tensor per layer: ``2 * layers * kv_heads * head_dim * block`` floats, 1.5 MiB for a block of
  32 on SmolLM2-135M);
* **bound**: at most ``max_tokens`` tokens are kept; the least recently used block goes first,
  with the blocks after it (they cannot match without it);
* **validity**: entries of an adapter are dropped when it leaves the model
  (:meth:`PrefixCache.forget`: a name loaded again may be different weights), and everything is
  dropped when another tenant of a shared model had a turn (:meth:`PrefixCache.clear`: it may
  have changed weights). Reused keys and values were computed in another batch, so a reused row
  differs from a fresh prefill by float rounding only, as any batched row does.

Why not ``transformers``' own block sharing: it lives in ``PagedAttentionCache`` and its
allocators, whose blocks are read only by the paged attention functions with the manager's
flattened batch layout (one row of all requests' tokens, ``cu_seq_lens``); the batch here is the
ordinary ``[B, W]`` layout of ``DynamicCache`` (so PEFT, the grouped LoRA hooks and any model's
own attention run unchanged), and a reused prefix is simply copied into a ``DynamicCache`` that
the pass starts from. The matching rule (complete blocks chained from the first, at least one
token left to run) is the same.

Runs on the model thread only; nothing is thread-safe.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

import torch

__all__ = ["PrefixCache"]


@dataclass(eq=False)
class _Block:
    key: tuple  # (adapter, parent block id or 0, tokens)
    id: int
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [heads, block, head_dim]
    children: set[int] = field(default_factory=set)


class PrefixCache:
    """Cached key/value blocks of prompt prefixes, per adapter.

    Args:
        block: tokens per block (the reuse granularity), >= 1.
        max_tokens: cached tokens at most over all adapters (``max_tokens // block`` blocks);
            0 turns caching off.

    Attributes:
        hit_tokens, lookup_tokens: prompt tokens found cached, and prompt tokens looked up (for
            tests and benchmarks).
    """

    def __init__(self, *, block: int = 16, max_tokens: int = 1024) -> None:
        if block < 1:
            raise ValueError(f"block: expected an integer >= 1, got {block}")
        if max_tokens < 0:
            raise ValueError(f"max_tokens: expected an integer >= 0, got {max_tokens}")
        self.block = block
        self.max_blocks = max_tokens // block
        self._by_key: dict[tuple, _Block] = {}
        self._by_id: OrderedDict[int, _Block] = OrderedDict()  # least recently used first
        self._ids = itertools.count(1)
        self.hit_tokens = 0
        self.lookup_tokens = 0

    @property
    def tokens(self) -> int:
        """Tokens cached now."""
        return len(self._by_id) * self.block

    def _chain(self, adapter: str | None, prompt: Sequence[int], blocks: int) -> list[_Block]:
        chain, parent = [], 0
        for b in range(blocks):
            node = self._by_key.get((adapter, parent, tuple(prompt[b * self.block : (b + 1) * self.block])))
            if node is None:
                break
            chain.append(node)
            parent = node.id
        return chain

    def match(self, adapter: str | None, prompt: Sequence[int]) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]:
        """The longest cached prefix of ``prompt`` on ``adapter`` (``None``: the base model) that
        leaves at least one token to run.

        Returns ``(L, kv)``: ``L`` tokens (a multiple of :attr:`block`, 0 when nothing matched)
        and per layer their keys and values ``[heads, L, head_dim]`` (empty when ``L == 0``)."""
        self.lookup_tokens += len(prompt)
        if not self.max_blocks:
            return 0, []
        chain = self._chain(adapter, prompt, (len(prompt) - 1) // self.block)
        if not chain:
            return 0, []
        for node in chain:  # parents before children: a child is never older than its parent
            self._by_id.move_to_end(node.id)
        length = len(chain) * self.block
        self.hit_tokens += length
        if len(chain) == 1:
            return length, list(chain[0].kv)
        layers = len(chain[0].kv)
        kv = [
            (
                torch.cat([node.kv[i][0] for node in chain], dim=1),
                torch.cat([node.kv[i][1] for node in chain], dim=1),
            )
            for i in range(layers)
        ]
        return length, kv

    def store(self, adapter: str | None, prompt: Sequence[int], layers, row: int, columns: Sequence[int]) -> None:
        """Keep the complete blocks of ``prompt`` not cached yet, from a prefilled cache.

        Args:
            adapter: the adapter that ran the prompt (``None``: the base model).
            prompt: its token ids.
            layers: the cache's layers (each with ``keys`` / ``values`` ``[B, heads, W, head_dim]``).
            row: the prompt's row in them.
            columns: ``columns[t]`` is the cache column of prompt token ``t`` (``len(prompt)`` of
                them), or -1 where that token was not run in this pass (it came from the cache:
                it must then be cached already).
        """
        if not self.max_blocks:
            return
        complete = len(prompt) // self.block
        parent = 0
        for b in range(complete):
            key = (adapter, parent, tuple(prompt[b * self.block : (b + 1) * self.block]))
            node = self._by_key.get(key)
            if node is None:
                first = columns[b * self.block]
                if first < 0:
                    return  # a block from the cache was evicted meanwhile: nothing to chain to
                sl = slice(first, first + self.block)
                kv = [(layer.keys[row, :, sl].clone(), layer.values[row, :, sl].clone()) for layer in layers]
                node = _Block(key, next(self._ids), kv)
                self._by_key[key] = node
                self._by_id[node.id] = node
                if parent:
                    self._by_id[parent].children.add(node.id)
                self._evict()
                if node.id not in self._by_id:
                    return
            else:
                self._by_id.move_to_end(node.id)
            parent = node.id

    def _evict(self) -> None:
        while len(self._by_id) > self.max_blocks:
            self._drop(next(iter(self._by_id)))

    def _drop(self, block_id: int) -> None:
        node = self._by_id.pop(block_id, None)
        if node is None:
            return
        self._by_key.pop(node.key, None)
        parent = self._by_id.get(node.key[1])
        if parent is not None:
            parent.children.discard(block_id)
        for child in list(node.children):
            self._drop(child)

    def forget(self, adapter: str | None) -> None:
        """Drop every block of ``adapter`` (it left the model; a later load may be other weights)."""
        for node in [n for n in self._by_id.values() if n.key[0] == adapter]:
            self._drop(node.id)

    def clear(self) -> None:
        """Drop everything (the weights may have changed)."""
        self._by_key.clear()
        self._by_id.clear()
