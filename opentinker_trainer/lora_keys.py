"""What PEFT loaded of a LoRA adapter file, for every place that loads one: a served adapter
(``inference/adapters.py``) and the adapter a training task continues (``workloads/_lm.py``:
its own resume point or an ``init_from`` checkpoint).

PEFT loads a file it only partly matches with a warning ("Found missing adapter keys") and goes
on: keys without the ``base_model.model.`` prefix match nothing (``lora_B`` stays 0, so the model
is the base model), and a file lacking a target module or some layers gives a partial adapter.
:func:`unloaded_keys` finds both, after loading; :func:`unloaded_message` says what they are.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "listed", "lora_module_of", "unloaded_keys", "unloaded_message"]

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"

_PARTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")


def lora_module_of(key: str) -> tuple[str, str] | None:
    """``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` ->
    (``model.layers.0.self_attn.q_proj``, ``lora_A``); None for a key that is not a LoRA tensor."""
    for part in _PARTS:
        marker = f".{part}."
        if marker in key or key.endswith(f".{part}"):
            module = key.split(marker)[0] if marker in key else key[: -len(part) - 1]
            for prefix in ("base_model.model.", "base_model."):
                if module.startswith(prefix):
                    module = module[len(prefix) :]
                    break
            return module, part
    return None


def unloaded_keys(model, name: str, path: Path) -> tuple[list[str], list[str]]:
    """What PEFT did not load of the adapter file in folder ``path`` into adapter ``name`` of
    ``model`` (a ``PeftModel`` that has just loaded it); reads the file's keys only.

    The adapter's tensors in ``model`` are named as PEFT saves them
    (``peft.get_peft_model_state_dict(model, adapter_name=name)``, e.g.
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``), the names PEFT's loader
    maps the file's keys onto; a key of one that the other lacks was not loaded.

    Returns:
        ``(missing, not_loaded)``, each sorted: ``missing`` — the adapter's tensors (one per
        module its config targets and LoRA part) with no key in the file, so left at their initial
        values (``lora_B`` 0); ``not_loaded`` — the file's LoRA keys that name none of them.

    Raises:
        FileNotFoundError: the folder has no ``adapter_model.safetensors``.
    """
    from peft import get_peft_model_state_dict
    from safetensors import safe_open

    weights = Path(path) / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise FileNotFoundError(f"adapter folder {path} has no {ADAPTER_WEIGHTS}")
    # LoRA tensors only: with lm_head targeted PEFT would count the frozen base weight too.
    expected = set(get_peft_model_state_dict(model, adapter_name=name, save_embedding_layers=False))
    with safe_open(str(weights), framework="pt") as f:
        in_file = set(f.keys())
    missing = sorted(expected - in_file)
    not_loaded = sorted(k for k in in_file - expected if lora_module_of(k) is not None)
    return missing, not_loaded


def unloaded_message(missing: list[str], not_loaded: list[str]) -> str:
    """The two lists of :func:`unloaded_keys` for a person: counts and the first keys of each."""
    parts = []
    if missing:
        parts.append(f"{len(missing)} tensor(s) its config targets are not in the file: {listed(missing)}")
    if not_loaded:
        parts.append(f"{len(not_loaded)} LoRA key(s) of the file match none of them: {listed(not_loaded)}")
    return (
        f"not every LoRA tensor was loaded ({'; '.join(parts)}); PEFT names them "
        "base_model.model.<module>.lora_A.weight, one per targeted module"
    )


def listed(keys: list[str], limit: int = 10) -> str:
    """The first ``limit`` of ``keys``, comma-separated, and how many there are in all past that."""
    return ", ".join(keys[:limit]) + (f" ... ({len(keys)} in all)" if len(keys) > limit else "")
