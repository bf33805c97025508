"""Helpers of the language-model workloads: loading, dtypes, adapters, checkpoints, logging."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import structlog
import torch

from opentinker_trainer.context import UserError
from opentinker_trainer.workloads import _rng

TRAINER_STATE = "trainer_state.pt"
TRAINER_STATE_VERSION = 1


def get_logger(name: str):
    """A structlog logger. Logs must never reach stdout (the JSON report channel): when nobody
    configured structlog yet, point its default printer at stderr, keeping its other defaults."""
    if not structlog.is_configured():
        structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    return structlog.get_logger(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on a CUDA device that supports it, else float32; otherwise as named."""
    if name == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or name in (".", "..") or (os.sep != "/" and os.sep in name)


def load_model(name: str, device: torch.device, dtype: torch.dtype, *, tokenizer_from: str | None = None):
    """``(tokenizer, model)`` from a model folder or hub id, via the ordinary ``from_pretrained``;
    the tokenizer from ``tokenizer_from`` when given (a checkpoint saved without one).

    Raises:
        UserError: the folder does not exist, or the id/folder cannot be loaded (not found, not a
            causal LM, no network to the hub ...); the message names the model.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(name).expanduser()
    if _looks_like_path(name) and not path.exists():
        raise UserError(f"model {name!r} does not exist: no such folder on this trainer node")
    source = str(path) if path.exists() else name
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_from or source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    except (OSError, ValueError, KeyError, ImportError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"cannot load model {name!r} as a causal language model: {first} "
            "(name a model folder on the trainer node or a hub id it can download)"
        ) from exc
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer, model.to(device)


def stop_token_ids(tokenizer, model) -> list[int]:
    """Token ids that end a completion: the tokenizer's EOS plus the model's generation EOS ids
    (Qwen's instruct models end a turn with ``<|im_end|>`` and list ``<|endoftext|>`` too)."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(gen_eos, int):
        ids.add(gen_eos)
    elif gen_eos:
        ids.update(int(i) for i in gen_eos)
    if not ids:
        raise UserError("the model's tokenizer defines no end-of-sequence token; cannot tell where a reply ends")
    return sorted(ids)


@contextlib.contextmanager
def peft_wrapping():
    """``with peft_wrapping():`` around ``get_peft_model`` / ``PeftModel.from_pretrained``.

    PEFT 0.21's ``PeftModel.__init__`` asks ``getattr(model, "is_gradient_checkpointing", True)``
    (peft/peft_model.py), a property transformers 5 keeps only as a deprecated alias of
    ``is_activation_checkpointing`` and that warns (``FutureWarning``) on every read: one warning
    at every task start, about code that is not ours. This ignores exactly that message, only
    while PEFT wraps the model; every other warning still shows. Drop it once PEFT reads
    ``is_activation_checkpointing``."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def attach_lora(model, cfg, resume_from: Path | None, *, what: str = "checkpoint"):
    """Wrap ``model`` with a fresh trainable LoRA adapter, or the one saved at ``resume_from``
    (checked by :func:`load_adapter`; ``what`` names that folder in its errors)."""
    from peft import LoraConfig, get_peft_model

    if resume_from is not None:
        return load_adapter(model, resume_from, what=what, is_trainable=True)
    config = LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=list(cfg.target_modules),
        task_type="CAUSAL_LM",
    )
    try:
        with peft_wrapping():
            return get_peft_model(model, config)
    except ValueError as exc:  # e.g. "Target modules {...} not found in the base model"
        raise UserError(f"hyperparameters.target_modules {list(cfg.target_modules)}: {exc}") from exc


def load_adapter(model, path: Path, *, what: str = "checkpoint", is_trainable: bool = True):
    """``model`` wrapped in a ``PeftModel`` with the LoRA adapter saved in folder ``path``, once
    PEFT is seen to have loaded all of it (:func:`opentinker_trainer.lora_keys.unloaded_keys`).

    PEFT itself loads a file it only partly matches with a warning and goes on, so a task would
    train from a fresh ``lora_B`` of 0 (keys without the ``base_model.model.`` prefix) or from a
    partial adapter (a target module or some layers missing) without a word.

    Raises:
        UserError: the folder has no ``adapter_model.safetensors``, a module its config targets got
            no weights, or a LoRA key of the file matched nothing; the message lists the keys.
    """
    from peft import PeftModel

    from opentinker_trainer.lora_keys import unloaded_keys, unloaded_message

    with peft_wrapping():
        loaded = PeftModel.from_pretrained(model, str(path), adapter_name="default", is_trainable=is_trainable)
    try:
        missing, not_loaded = unloaded_keys(loaded, "default", path)
    except FileNotFoundError as exc:
        raise UserError(f"{what} {path} is not a PEFT LoRA adapter: {exc}") from None
    if missing or not_loaded:
        raise UserError(f"{what} {path}: {unloaded_message(missing, not_loaded)}")
    return loaded


def rng_state(env_state: Any) -> dict[str, Any]:
    """The global RNG states (:func:`opentinker_trainer.workloads._rng.rng_state`) plus
    ``"env"``: the environment's own state (or None)."""
    return {**_rng.rng_state(), "env": env_state}


def restore_rng(state: dict[str, Any]) -> Any:
    """Restore the global RNGs saved by :func:`rng_state`; return the environment's saved state."""
    _rng.restore_rng_state(state)
    return state.get("env")


def save_checkpoint(
    path: Path, model, trainer_state: dict[str, Any], *, tokenizer=None, base_model: str | None = None
) -> Path:
    """Write the adapter (PEFT format) and ``trainer_state.pt`` to ``path`` atomically.

    For a plain (non-PEFT) model ``save_pretrained`` writes the full weights; pass ``tokenizer``
    too so the folder loads on its own with ``from_pretrained`` (format ``hf_full``).

    ``base_model``: the base model as the user named it (``spec.model``: a hub id or model name).
    PEFT writes the folder the base weights were loaded from into ``adapter_config.json``
    (``base_model_name_or_path``), which may be a path on this node (an ``init_from`` full-weight
    checkpoint, a resolved model folder); the saved adapter names ``base_model`` instead, so it
    means the same thing once downloaded elsewhere.

    The folder is written beside its final name and renamed into place, so a reader (or a resume
    after a crash) never sees half a checkpoint.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    _save_weights(model, tmp)
    adapter_config = tmp / "adapter_config.json"
    if base_model and adapter_config.exists():
        config = json.loads(adapter_config.read_text())
        config["base_model_name_or_path"] = base_model
        adapter_config.write_text(json.dumps(config, indent=2, sort_keys=True))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))
    torch.save({"version": TRAINER_STATE_VERSION, **trainer_state}, tmp / TRAINER_STATE)
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)
    return path


def _save_weights(model, folder: Path) -> None:
    """``model.save_pretrained(folder)``, for a PEFT model its LoRA weights only; for one with
    several adapters (a model host's tenants, :mod:`opentinker_trainer.host`) only the active one,
    its files at the top of ``folder`` exactly as a model with that adapter alone writes them
    (PEFT puts an adapter not named ``default`` in a subfolder of its name)."""
    adapter = getattr(model, "active_adapter", None) if hasattr(model, "peft_config") else None
    if adapter is None:
        model.save_pretrained(str(folder))
        return
    # The base's embedding and lm_head weights are frozen: an adapter on lm_head saves its LoRA
    # matrices alone, not PEFT's default copy of the (vocab x hidden) base weights.
    if adapter == "default":
        model.save_pretrained(str(folder), save_embedding_layers=False)
        return
    model.save_pretrained(str(folder), selected_adapters=[adapter], save_embedding_layers=False)
    sub = folder / adapter
    for f in sub.iterdir():
        os.replace(f, folder / f.name)
    sub.rmdir()


def save_step(
    ctx,
    step: int,
    model,
    optimizer: torch.optim.Optimizer,
    cfg,
    *,
    fmt: str,
    log,
    final: bool,
    tokenizer=None,
    env_state: Any = None,
    extra_state: dict[str, Any] | None = None,
) -> Path:
    """Write the checkpoint of an LM trainer after ``step`` and report it: ``<checkpoint_dir>/step_<step>``.

    ``extra_state``: further entries of ``trainer_state.pt`` (a distributed attempt's
    ``rng_ranks`` and ``world_size``, :func:`opentinker_trainer.distributed.save_once`).

    The folder is :func:`save_checkpoint`'s: the weights (``fmt`` :data:`FORMAT_LORA`: the PEFT
    adapter; :data:`FORMAT_FULL`: all weights plus ``tokenizer``) and ``trainer_state.pt`` with
    ``step``, ``optimizer`` (its ``state_dict``), ``rng`` (:func:`rng_state` with ``env_state``),
    ``model`` (``spec.model``) and ``hyperparameters`` (``cfg`` as a dict). Then
    ``ctx.emit_checkpoint`` reports it (``final``: the attempt's last) and ``log`` logs it.

    Returns:
        The checkpoint folder.
    """
    path = Path(ctx.checkpoint_dir) / f"step_{step}"
    state = {
        "step": step,
        "optimizer": optimizer.state_dict(),
        "rng": rng_state(env_state),
        "model": ctx.spec.model,
        "hyperparameters": dataclasses.asdict(cfg),
        **(extra_state or {}),
    }
    save_checkpoint(
        path, model, state, tokenizer=tokenizer if fmt == FORMAT_FULL else None, base_model=ctx.spec.model or None
    )
    ctx.emit_checkpoint(step, path, final=final, fmt=fmt)
    log.info("checkpoint written", task_id=ctx.task_id, step=step, path=str(path), final=final, format=fmt)
    return path


def resume_step(ctx, optimizer: torch.optim.Optimizer, log) -> tuple[int, Any]:
    """Resume an LM trainer from ``ctx.resume_from`` (a :func:`save_step` folder), if any.

    Loads the optimizer state into ``optimizer`` and restores the global RNGs.

    Returns:
        ``(step, env_state)``: the step the checkpoint was written after and the environment
        state saved with it; ``(0, None)`` on a fresh start.

    Raises:
        FileNotFoundError: the folder has no ``trainer_state.pt``.
    """
    if ctx.resume_from is None:
        return 0, None
    state = load_trainer_state(ctx.resume_from)
    optimizer.load_state_dict(state["optimizer"])
    env_state = restore_rng(state["rng"])
    step = int(state["step"])
    log.info("resumed", task_id=ctx.task_id, checkpoint=str(ctx.resume_from), step=step)
    return step, env_state


def load_trainer_state(path: Path) -> dict[str, Any]:
    """The ``trainer_state.pt`` of checkpoint folder ``path`` (tensors on CPU)."""
    file = Path(path) / TRAINER_STATE
    if not file.exists():
        raise FileNotFoundError(f"checkpoint {path} has no {TRAINER_STATE}; cannot resume from it")
    return torch.load(file, map_location="cpu", weights_only=True)


# ---------------------------------------------------------------------------------------------
# Starting points: spec.model, an init_from task's checkpoint, or this task's own resume point.

#: Checkpoint formats: a PEFT LoRA adapter folder; a full transformers ``save_pretrained`` folder.
FORMAT_LORA = "peft_lora"
FORMAT_FULL = "hf_full"
#: How errors name an ``init_from`` checkpoint.
INIT_WHAT = "init_from: checkpoint"


def _check_init(ctx) -> tuple[Path | None, str]:
    init = getattr(ctx, "init_checkpoint", None)
    fmt = getattr(ctx, "init_format", "") or ""
    if init is None:
        return None, ""
    if fmt not in (FORMAT_LORA, FORMAT_FULL):
        raise UserError(f"init_from: checkpoint {init} has format {fmt!r}; expected {FORMAT_LORA} or {FORMAT_FULL}")
    if not Path(init).exists():
        raise UserError(
            f"init_from: checkpoint {init} is not on this trainer node (checkpoints stay on the node that wrote "
            "them unless the nodes share a folder); run both tasks on one node or share the work folder"
        )
    return Path(init), fmt


def load_for_training(ctx, cfg, device: torch.device, dtype: torch.dtype, *, full: bool, resume: bool = True):
    """``(tokenizer, model)`` at this attempt's starting point, ready to train.

    * ``full=False`` (LoRA): base weights from ``spec.model``, or from an ``init_from`` full-weight
      (``hf_full``) checkpoint; the adapter is this task's ``resume_from``, else an ``init_from``
      LoRA adapter (continued, its rank and targets kept), else a fresh one (``cfg.lora_*``).
    * ``full=True`` (all weights): ``resume_from`` (a full checkpoint of this task), else the
      ``init_from`` full weights, else ``spec.model`` with an ``init_from`` LoRA adapter merged in.

    ``resume=False`` ignores ``resume_from`` (the starting weights, e.g. for a KL reference).

    Raises:
        UserError: the model or checkpoint cannot be loaded, or is not on this node.
    """
    init, fmt = _check_init(ctx)
    own = ctx.resume_from if resume else None
    if full:
        source = own or (init if fmt == FORMAT_FULL else None) or ctx.spec.model
        with ctx.loading_model(str(source)):
            tokenizer, model = load_model(str(source), device, dtype)
        if own is None and fmt == FORMAT_LORA:
            model = load_adapter(model, init, what=INIT_WHAT, is_trainable=False).merge_and_unload()
        model.requires_grad_(True)
        torch.manual_seed(cfg.seed)  # sampling starts from the seed, as with LoRA
        return tokenizer, model
    source = init if fmt == FORMAT_FULL else ctx.spec.model
    with ctx.loading_model(str(source)):
        tokenizer, base = load_model(str(source), device, dtype)
        torch.manual_seed(cfg.seed)  # a fresh adapter's initial weights
        if own is not None:
            return tokenizer, attach_lora(base, cfg, own, what="resume_from: checkpoint")
        return tokenizer, attach_lora(base, cfg, init if fmt == FORMAT_LORA else None, what=INIT_WHAT)


def frozen_reference(ctx, cfg, model, device: torch.device, dtype: torch.dtype):
    """A frozen copy of a full-weight policy's starting weights (for a KL penalty): a deep copy of
    ``model`` on a fresh start, reloaded from the starting point when resuming."""
    import copy

    ref = (
        load_for_training(ctx, cfg, device, dtype, full=True, resume=False)[1]
        if ctx.resume_from
        else copy.deepcopy(model)
    )
    ref.requires_grad_(False)
    return ref.eval()
