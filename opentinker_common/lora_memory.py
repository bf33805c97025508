"""GPU memory of LoRA tenants on a shared base model, estimated from the spec and the model's
``config.json``. Pure functions on frozen values (no I/O, no torch), except :func:`read_model_config`.

Units: bytes throughout; parameter counts are plain counts.

The model (a Llama-style decoder: Llama, SmolLM2, Qwen2, Mistral; biases are not counted):

* ``base_parameters`` = V*d (embeddings) + L * (d*(H*h) + 2*d*(K*h) + (H*h)*d + 3*d*I + 2*d) + d
  (final norm) + V*d unless the embeddings are tied (``tie_word_embeddings``), with V the vocabulary,
  d ``hidden_size``, L ``num_hidden_layers``, H ``num_attention_heads``, K ``num_key_value_heads``,
  h ``head_dim`` (default d/H), I ``intermediate_size``;
* ``base_bytes`` = base_parameters * the bytes of the base's dtype (float32 4, bfloat16/float16 2).

A LoRA adapter (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models",
https://arxiv.org/abs/2106.09685, section 4.1) adds ``A`` (r x d_in) and ``B`` (d_out x r) to each
adapted matrix W (d_out x d_in): r*(d_in + d_out) parameters, in each of the L layers.

A tenant's bytes (:func:`tenant_bytes`) are its adapter's parameters times
:data:`TENANT_BYTES_PER_PARAMETER` = 16: the weight in float32 (PEFT keeps adapters in float32,
``autocast_adapter_dtype``; being float32 it is its own master copy), its gradient in float32, and
AdamW's two float32 moments (Kingma & Ba 2015, "Adam", https://arxiv.org/abs/1412.6980). Not
counted: activations, the KV cache of rollouts and the CUDA context; they scale with the batch
and sequence length, not with the tenant count, so placement leaves them to the GPU's headroom.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

#: Bytes of one parameter of each base dtype (``hyperparameters.dtype``; ``auto`` reads the config).
DTYPE_BYTES: Mapping[str, int] = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}

#: Bytes per adapter parameter a training tenant holds: float32 weight 4 + gradient 4 + AdamW's
#: exp_avg 4 and exp_avg_sq 4.
TENANT_BYTES_PER_PARAMETER = 16

GIB = 1024**3
MIB = 1024**2


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama-style decoder that set its parameter count (see the module docstring)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool
    dtype_bytes: int

    @classmethod
    def from_config(cls, config: Mapping[str, Any], dtype: str = "auto") -> ModelShape:
        """The shape a transformers ``config.json`` (as a dict) describes, its weights in ``dtype``
        (``auto``: the config's ``torch_dtype``/``dtype``, float32 when it names none).

        Raises:
            ValueError: a size is missing or not a positive integer (named), or the dtype is unknown.
        """

        def size(key: str, default: Any = None) -> int:
            value = config.get(key, default)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"config.json: expected {key}, a positive integer, got {value!r}")
            return value

        d, heads = size("hidden_size"), size("num_attention_heads")
        name = dtype
        if dtype == "auto":
            name = str(config.get("torch_dtype") or config.get("dtype") or "float32")
        if name not in DTYPE_BYTES:
            raise ValueError(f"dtype: expected one of {sorted(DTYPE_BYTES)} or auto, got {name!r}")
        return cls(
            hidden_size=d,
            num_layers=size("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=size("num_key_value_heads", heads),
            head_dim=size("head_dim") if config.get("head_dim") is not None else d // heads,
            intermediate_size=size("intermediate_size"),
            vocab_size=size("vocab_size"),
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            dtype_bytes=DTYPE_BYTES[name],
        )

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """Module name -> (d_in, d_out) of each linear layer of one decoder layer."""
        d, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {
            "q_proj": (d, q),
            "k_proj": (d, kv),
            "v_proj": (d, kv),
            "o_proj": (q, d),
            "gate_proj": (d, i),
            "up_proj": (d, i),
            "down_proj": (i, d),
        }


def base_parameters(shape: ModelShape) -> int:
    """Parameters of the base model (formula in the module docstring)."""
    d, v = shape.hidden_size, shape.vocab_size
    per_layer = sum(a * b for a, b in shape.linear_shapes().values()) + 2 * d
    return v * d * (1 if shape.tied_embeddings else 2) + shape.num_layers * per_layer + d


def base_bytes(shape: ModelShape) -> int:
    """Bytes of the base weights on the GPU: ``base_parameters * dtype_bytes``."""
    return base_parameters(shape) * shape.dtype_bytes


def lora_parameters(shape: ModelShape, rank: int, target_modules: Iterable[str]) -> int:
    """Parameters of a LoRA adapter of rank ``rank`` on ``target_modules`` in every layer:
    ``L * sum(r * (d_in + d_out))`` over the adapted matrices (LoRA paper, section 4.1), plus
    ``r * (d + vocab)`` once for ``lm_head``, the output projection.

    Raises:
        ValueError: ``rank`` < 1, or a module name this shape has no size for (named, with the known ones).
    """
    if rank < 1:
        raise ValueError(f"lora_rank: expected a positive integer, got {rank}")
    shapes = shape.linear_shapes()
    total = head = 0
    for name in dict.fromkeys(target_modules):
        if name == "lm_head":
            head = rank * (shape.hidden_size + shape.vocab_size)
            continue
        if name not in shapes:
            raise ValueError(f"target_modules: no size known for {name!r}; known: {', '.join(shapes)}, lm_head")
        d_in, d_out = shapes[name]
        total += rank * (d_in + d_out)
    return shape.num_layers * total + head


def tenant_bytes(shape: ModelShape, rank: int, target_modules: Iterable[str]) -> int:
    """Bytes one training tenant adds to a host: ``lora_parameters * TENANT_BYTES_PER_PARAMETER``
    (float32 weight, gradient and AdamW's two moments). Raises what :func:`lora_parameters` raises."""
    return lora_parameters(shape, rank, target_modules) * TENANT_BYTES_PER_PARAMETER


#: Bytes per adapter parameter a serving tenant holds: the float32 weight alone (no gradient,
#: no optimizer state).
SERVING_BYTES_PER_PARAMETER = 4
#: Rank and target modules assumed for adapters a serving tenant will load (not known when it is
#: placed): the training workloads' defaults.
SERVING_RANK = 16
SERVING_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def serving_bytes(shape: ModelShape, adapters: int) -> int:
    """Bytes a serving tenant (an ``inference`` task on a model host) adds: ``adapters`` resident
    adapters (``max_resident_adapters``) of rank :data:`SERVING_RANK` on :data:`SERVING_TARGETS`,
    ``lora_parameters * SERVING_BYTES_PER_PARAMETER`` each. Not counted: the KV cache of its
    batch (it scales with ``max_batch_tokens``, left to the GPU's headroom like activations).

    Raises:
        ValueError: ``adapters`` < 1.
    """
    if adapters < 1:
        raise ValueError(f"max_resident_adapters: expected a positive integer, got {adapters}")
    return adapters * lora_parameters(shape, SERVING_RANK, SERVING_TARGETS) * SERVING_BYTES_PER_PARAMETER


def fmt_bytes(n: int) -> str:
    """``n`` bytes for a person: GiB with two decimals from 1 GiB up, else MiB with one."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB"


def read_model_config(model: str) -> dict[str, Any] | None:
    """The ``config.json`` of ``model`` (a model folder, or a hub id found in the local Hugging Face
    cache, ``$HF_HUB_CACHE`` or ``$HF_HOME/hub`` or ``~/.cache/huggingface/hub``), or None when it is
    in neither place or is not a JSON object. Reads files only; never downloads."""
    candidates = [Path(model) / "config.json"]
    if model.count("/") == 1 and not model.startswith((".", "/")):
        hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
            os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface"), "hub"
        )
        snapshots = Path(hub) / ("models--" + model.replace("/", "--")) / "snapshots"
        if snapshots.is_dir():
            candidates += sorted(snapshots.glob("*/config.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    for path in candidates:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            return data
    return None
