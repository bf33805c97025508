"""Many LoRA adapters on one base model: validation, loading on demand, least-recently-used bound.

The base model is loaded once. The first adapter wraps it in a ``peft.PeftModel``; later ones are
added with ``load_adapter(path, adapter_name=...)`` and removed with ``delete_adapter``. Which
adapter a forward pass uses is chosen right before it (:meth:`AdapterRegistry.activate`): the
named adapter alone, or none at all for a base-model request (LoRA layers disabled). The caller
runs every forward pass and every load on one thread, so a pass never sees another request's
adapter.

An adapter is refused before loading when its files are not a LoRA adapter of this base model
(:func:`validate_adapter`): no ``adapter_model.safetensors``, no ``lora_A``/``lora_B`` tensors,
or tensors for modules the base model does not have or with the wrong shapes. PEFT itself would
load such a file with a warning and then silently serve the base model.

It is refused after loading too, and taken off the model again, unless PEFT loaded all of it
(:func:`opentinker_trainer.lora_keys.unloaded_keys`, which the training workloads use too): every
LoRA tensor of the file went into the adapter, and every module the adapter's config targets got
its weights. Otherwise keys without the ``base_model.model.`` prefix (PEFT matches none of them:
``lora_B`` stays 0, the outputs are the base model's), or a file lacking a target module or some
layers, would be served as the base or a partial adapter.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from opentinker_trainer.inference.lora_rows import RowLoRA
from opentinker_trainer.inference.lora_rows import supports as row_lora_supports
from opentinker_trainer.lora_keys import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    lora_module_of,
    unloaded_keys,
    unloaded_message,
)

__all__ = [
    "AdapterError",
    "AdapterNotFound",
    "AdapterRefused",
    "AdaptersBusy",
    "AdapterInfo",
    "AdapterRegistry",
    "unloaded_keys",
    "validate_adapter",
]

WEIGHTS = ADAPTER_WEIGHTS
CONFIG = ADAPTER_CONFIG


class AdapterError(Exception):
    """Base of adapter errors; the server maps each subclass to a gRPC status."""


class AdapterNotFound(AdapterError):
    """NOT_FOUND: no such adapter (unknown task, or a task without a checkpoint)."""


class AdapterRefused(AdapterError):
    """FAILED_PRECONDITION: the adapter exists but cannot be served on this base model."""


class AdaptersBusy(AdapterError):
    """RESOURCE_EXHAUSTED: every resident slot is held by a running request."""


@dataclass(frozen=True)
class AdapterInfo:
    """A resident adapter. ``size_bytes``: bytes of its LoRA tensors; times are unix seconds."""

    name: str
    path: str
    size_bytes: int
    load_time: float
    last_used_time: float
    in_use: int


def validate_adapter(path: Path, base_model) -> int:
    """Check that folder ``path`` holds a LoRA adapter for ``base_model`` (reads keys and shapes
    only, no tensor data). Returns the bytes of its LoRA tensors.

    Raises:
        AdapterRefused: no adapter files; no LoRA tensors; keys naming modules the base model
            lacks; tensor shapes that do not fit the base modules. The message lists the keys.
    """
    from safetensors import safe_open

    path = Path(path)
    weights = path / WEIGHTS
    if not weights.is_file() or not (path / CONFIG).is_file():
        raise AdapterRefused(f"adapter folder {path} has no {WEIGHTS} and {CONFIG}; not a PEFT LoRA checkpoint")
    try:
        json.loads((path / CONFIG).read_text())
    except ValueError as exc:
        raise AdapterRefused(f"adapter {path}: {CONFIG} is not valid JSON: {exc}") from None
    modules = dict(base_model.named_modules())
    size = 0
    lora_keys, unmatched, bad_shape = [], [], []
    try:
        with safe_open(str(weights), framework="pt") as f:
            keys = list(f.keys())
            for key in keys:
                found = lora_module_of(key)
                if found is None:
                    continue
                module_name, part = found
                lora_keys.append(key)
                sl = f.get_slice(key)
                shape = list(sl.get_shape())
                size += _numel(shape) * _DTYPE_BYTES.get(sl.get_dtype(), 4)
                module = modules.get(module_name)
                if module is None:
                    unmatched.append(key)
                    continue
                fits = _fits(module, part, shape)
                if fits is not None:
                    bad_shape.append(f"{key} {shape} (expected {fits})")
    except AdapterRefused:
        raise
    except Exception as exc:  # noqa: BLE001 - a corrupt file, whatever safetensors says about it
        raise AdapterRefused(f"adapter {path}: cannot read {WEIGHTS}: {exc}") from None
    if not lora_keys:
        shown = ", ".join(keys[:8]) + (" ..." if len(keys) > 8 else "") if keys else "none"
        raise AdapterRefused(f"adapter {path} has no LoRA tensors (no lora_A/lora_B keys; keys found: {shown})")
    if unmatched:
        raise AdapterRefused(
            f"adapter {path} does not match the base model: {len(unmatched)} LoRA key(s) name modules the base model "
            f"does not have: {', '.join(unmatched[:10])}{' ...' if len(unmatched) > 10 else ''}"
        )
    if bad_shape:
        raise AdapterRefused(
            f"adapter {path} does not match the base model: tensor shapes differ: {'; '.join(bad_shape[:10])}"
            f"{' ...' if len(bad_shape) > 10 else ''}"
        )
    return size


_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1}


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _fits(module, part: str, shape: list[int]) -> str | None:
    """None when a ``part`` tensor of ``shape`` fits ``module``; else the expected shape."""
    base = getattr(module, "base_layer", module)
    fan_in = getattr(base, "in_features", None)
    fan_out = getattr(base, "out_features", None)
    if fan_in is None or fan_out is None or len(shape) != 2:
        return None  # embeddings, convolutions: leave it to PEFT
    if part == "lora_A" and shape[1] != fan_in:
        return f"[r, {fan_in}]"
    if part == "lora_B" and shape[0] != fan_out:
        return f"[{fan_out}, r]"
    return None


@dataclass
class _Resident:
    name: str
    path: str
    size_bytes: int
    load_time: float
    last_used: float
    in_use: int = 0


class AdapterRegistry:
    """The served model and its resident adapters.

    Args:
        model: the base causal LM, already in eval mode on its device.
        resolve: adapter name -> checkpoint folder; raises :class:`AdapterNotFound` /
            :class:`AdapterRefused` (the workload asks the scheduler; tests pass a dict lookup).
        max_resident: most adapters kept loaded; the least recently used idle one goes first.

        shared: a model host (:class:`opentinker_trainer.host.ModelHost`) whose ``PeftModel``
            (its ``model`` attribute, None until its first adapter) this registry adds its
            adapters to, next to the host's training tenants' adapters; ``model`` is then the
            host's base. None: the registry owns the model.
        prefix: with ``shared``, the start of every PEFT adapter name this registry loads
            (``<prefix><name>~``, ``.`` written ``_``): a serving tenant's own, so its names never
            collide with a training tenant's (``t<task>-a<attempt>``) or another registry's, and
            no name is a substring of another (PEFT picks an adapter's tensors by substring).

    :meth:`acquire`, :meth:`activate` and the model's forward passes must run on one thread (the
    server's model thread); :meth:`release` and :meth:`list` may be called from any thread. On a
    shared model every model-thread call runs in the serving tenant's turn and ends with
    :meth:`leave_turn`.
    """

    def __init__(
        self,
        model,
        resolve: Callable[[str], Path] | None = None,
        *,
        max_resident: int = 8,
        shared=None,
        prefix: str = "",
    ) -> None:
        if max_resident < 1:
            raise ValueError(f"max_resident must be >= 1, got {max_resident}")
        if shared is not None and not prefix:
            raise ValueError("prefix: expected a non-empty adapter name prefix on a shared model")
        self.base = model
        self._shared = shared
        self.prefix = prefix if shared is not None else ""
        self._model = model  # becomes a PeftModel with the first adapter
        self.resolve = resolve or _no_resolver
        self.max_resident = max_resident
        self._resident: OrderedDict[str, _Resident] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self._active: str | None | object = _UNKNOWN
        self._rows: RowLoRA | None = None  # stacked weights of the loaded adapters, built on first use
        self._rows_unsupported = False
        self.loads = 0
        self.evictions = 0
        #: Called with an adapter's name when it leaves the model (model thread): caches of
        #: what it computed are stale (:meth:`~.prefix_cache.PrefixCache.forget`).
        self.on_delete: Callable[[str], None] | None = None

    @property
    def model(self):
        """The served model: the base, or the ``PeftModel`` once an adapter was added (on a
        shared model: the host's, whoever added its first adapter)."""
        if self._shared is not None:
            return self._shared.model if self._shared.model is not None else self.base
        return self._model

    @model.setter
    def model(self, value) -> None:
        if self._shared is not None:
            self._shared.model = None if value is self.base else value
        else:
            self._model = value

    def peft_name(self, name: str) -> str:
        """The PEFT adapter name of adapter ``name`` (the name itself unless on a shared model)."""
        if not self.prefix:
            return name
        return f"{self.prefix}{name.replace('.', '_')}~"

    def peft_names(self, names: list[str]) -> list[str]:
        """:meth:`peft_name` of each name, ``"__base__"`` (PEFT's base row) kept as it is."""
        return [n if n == "__base__" else self.peft_name(n) for n in names]

    # --- requests --------------------------------------------------------------------------
    def is_resident(self, name: str) -> bool:
        with self._lock:
            return name in self._resident

    def acquire(self, name: str | None, path: Path | None = None) -> None:
        """Make adapter ``name`` resident (loading it from ``path``, else from ``resolve(name)``,
        evicting the least recently used idle one if full) and pin it until :meth:`release`.
        ``None`` is the base model: nothing to do.

        Raises:
            AdapterNotFound, AdapterRefused: from resolving or validating it.
            AdaptersBusy: the registry is full and every resident adapter is in use.
        """
        if name is None or self.pin_resident(name):
            return
        path = Path(path if path is not None else self.resolve(name))
        size = validate_adapter(path, self.base)
        with self._lock:
            self._make_room()
            self._load(name, path)
            now = time.time()
            self._resident[name] = _Resident(name, str(path), size, now, now, in_use=1)

    def _make_room(self) -> None:
        """With the lock held: unload the first idle resident adapter when every slot is taken.

        Raises:
            AdaptersBusy: every resident adapter is in use by running requests.
        """
        if len(self._resident) >= self.max_resident:
            victim = next((e for e in self._resident.values() if e.in_use == 0), None)
            if victim is None:
                raise AdaptersBusy(
                    f"all {self.max_resident} adapter slots are in use by running requests; retry later "
                    "(or raise max_resident_adapters)"
                )
            self._unload(victim.name)

    def acquire_copy(self, name: str, source: str) -> bool:
        """On a shared model: make ``name`` a resident copy of the host's adapter ``source`` (a
        training tenant's PEFT name) as it is now, pinned until :meth:`release` (already
        resident: just pinned). Model thread, inside a turn (so between the tenant's steps).
        Returns False, changing nothing, when ``source`` is not a plain LoRA adapter on
        ``Linear`` layers (the caller serves a checkpoint instead).

        Raises:
            AdaptersBusy: the registry is full and every resident adapter is in use.
        """
        import copy

        import torch

        from opentinker_trainer.inference.lora_rows import _lora_linear_type

        if self.pin_resident(name):
            return True
        model = self.model
        if self._shared is None or model is self.base or source not in model.peft_config:
            return False
        config = model.peft_config[source]
        linear = _lora_linear_type()
        layers = [m for m in model.modules() if hasattr(m, "lora_A") and source in m.lora_A]
        if (
            getattr(config, "modules_to_save", None)
            or getattr(config, "bias", "none") != "none"
            or getattr(config, "use_dora", False)
            or not layers
            or not all(isinstance(m, linear) for m in layers)
        ):
            return False
        with self._lock:
            self._make_room()
            frozen = copy.deepcopy(config)
            frozen.inference_mode = True
            peft = self.peft_name(name)
            model.add_adapter(peft, frozen)
            size = 0
            with torch.no_grad():
                for m in layers:
                    for part in (m.lora_A, m.lora_B):
                        part[peft].weight.copy_(part[source].weight)
                        part[peft].weight.requires_grad_(False)
                        size += part[peft].weight.numel() * part[peft].weight.element_size()
            model.eval()
            self._active = _UNKNOWN
            self._forget_rows()
            self.loads += 1
            now = time.time()
            self._resident[name] = _Resident(name, f"live:{source}", size, now, now, in_use=1)
        return True

    def pin_resident(self, name: str) -> bool:
        """Pin adapter ``name`` until :meth:`release` if it is resident (any thread: a pinned
        adapter is never evicted, and eviction runs under the same lock). False when it is not
        resident: call :meth:`acquire` on the model thread to load it."""
        with self._lock:
            entry = self._resident.get(name)
            if entry is None:
                return False
            entry.in_use += 1
            entry.last_used = time.time()
            self._resident.move_to_end(name)
            return True

    def release(self, name: str | None) -> None:
        """Unpin an adapter taken with :meth:`acquire`."""
        if name is None:
            return
        with self._lock:
            entry = self._resident.get(name)
            if entry is not None and entry.in_use > 0:
                entry.in_use -= 1
                entry.last_used = time.time()

    def activate(self, name: str | None) -> None:
        """Make the next forward pass use adapter ``name`` alone, or no adapter for ``None``."""
        if self._rows is not None:
            self._rows.plan = None
        if name == self._active:
            return
        if self.model is self.base:
            if name is not None:
                raise AdapterNotFound(f"adapter {name!r} is not loaded")
        elif name is None:
            self.model.base_model.disable_adapter_layers()
        else:
            if self._active is None or self._active is _UNKNOWN or self._active is _MIXED or self._active is _ROWS:
                self.model.base_model.enable_adapter_layers()
            self.model.set_adapter(self.peft_name(name), inference_mode=True)
        self._active = name

    def activate_mixed(self) -> None:
        """Let the next forward passes choose adapters per row (PEFT's ``adapter_names``): LoRA
        layers enabled; each row names its adapter or ``"__base__"``."""
        if self._rows is not None:
            self._rows.plan = None
        if self._active is _MIXED:
            return
        if self.model is not self.base:
            self.model.base_model.enable_adapter_layers()
        self._active = _MIXED

    def activate_rows(self, names: list[str | None]) -> bool:
        """Let the next forward passes run row ``b`` with adapter ``names[b]`` (``None``: the base
        model), grouped by adapter (:class:`~.lora_rows.RowLoRA`: the base once for all rows, each
        adapter's LoRA over only its rows). Returns False, changing nothing, when no adapter is
        loaded or one cannot run grouped (DoRA, LoRA bias, ``modules_to_save``, non-Linear
        layers): the caller then uses PEFT's ``adapter_names``."""
        if self.model is self.base:
            return False
        if self._rows is None:
            if self._rows_unsupported or not row_lora_supports(self.model):
                self._rows_unsupported = True
                return False
            own = list(self.model.peft_config) if self._shared is None else [self.peft_name(n) for n in self._resident]
            self._rows = RowLoRA(self.model, own)
        if self._active is not _ROWS:
            self.model.base_model.disable_adapter_layers()
            self._active = _ROWS
        self._rows.set_rows([None if n is None else self.peft_name(n) for n in names])
        return True

    def rows_mode(self) -> bool:
        """True when the next pass runs the base with LoRA layers off: no adapter loaded, all
        rows on the base (:meth:`activate` ``None``), or grouped rows (:meth:`activate_rows`)."""
        if self.model is self.base:
            return True
        return (self._active is None or self._active is _ROWS) and not self._rows_unsupported

    def save_rows(self) -> tuple:
        """What :meth:`restore_rows` puts back: the active mode and the grouped row plan (a pass
        of other rows may run in the middle of a pass in :meth:`rows_mode`, model thread)."""
        return self._active, self._rows, None if self._rows is None else self._rows.state()

    def restore_rows(self, saved: tuple) -> None:
        active, rows, state = saved
        if self.model is not self.base and (active is None or active is _ROWS):
            if not (self._active is None or self._active is _ROWS):
                self.model.base_model.disable_adapter_layers()  # a fallback pass turned them on
        self._active = active
        if self._rows is not None:
            if rows is self._rows:
                self._rows.restore(state)
            else:
                self._rows.set_state_none()

    def list(self) -> list[AdapterInfo]:
        """Resident adapters, most recently used first."""
        with self._lock:
            return [
                AdapterInfo(e.name, e.path, e.size_bytes, e.load_time, e.last_used, e.in_use)
                for e in reversed(self._resident.values())
            ]

    def enter_turn(self) -> bool:
        """Start a model-thread call on a shared model: a training tenant may have left the
        model in ``train()`` mode (dropout on); serving runs in eval mode. Returns whether the
        model was in train mode, for :meth:`leave_turn` (False on an own model: always eval)."""
        if self._shared is None or not self.model.training:
            return False
        self.model.eval()
        return True

    def leave_turn(self, training: bool = False) -> None:
        """End a model-thread call on a shared model: the next turn is a training tenant's, which
        expects the adapter layers on, no row plan and the mode it left (``training``: back to
        ``train()``), and this registry's next call starts from an unknown active adapter (the
        tenant sets its own). Nothing to do on an own model."""
        if self._shared is None:
            return
        if self._rows is not None:
            self._rows.plan = None
        if self._active is not _UNKNOWN and self.model is not self.base:
            self.model.base_model.enable_adapter_layers()
        self._active = _UNKNOWN
        if training:
            self.model.train()

    def unload_all(self) -> None:
        """Take every resident adapter off the model (model thread; the serving tenant ends)."""
        for name in list(self._resident):
            self._unload(name)

    def modules_in_eval(self) -> bool:
        """True when every module of the served model is in eval mode (dropout off)."""
        return not any(m.training for m in self.model.modules())

    # --- loading -----------------------------------------------------------------------------
    def _load(self, name: str, path: Path) -> None:
        from peft import PeftModel

        peft = self.peft_name(name)
        try:
            if self.model is self.base:
                self.model = PeftModel.from_pretrained(self.base, str(path), adapter_name=peft, is_trainable=False)
            else:
                self.model.load_adapter(str(path), adapter_name=peft, is_trainable=False)
        except (ValueError, KeyError, RuntimeError, OSError) as exc:
            # e.g. a rank or target module PEFT cannot build on this model
            if peft in getattr(self.model, "peft_config", {}):
                self._delete(name)
            raise AdapterRefused(f"adapter {name!r} ({path}) cannot be loaded on this base model: {exc}") from None
        missing, not_loaded = unloaded_keys(self.model, peft, path)
        if missing or not_loaded:
            self._delete(name)
            raise AdapterRefused(f"adapter {name!r} ({path}): {unloaded_message(missing, not_loaded)}")
        self.model.eval()  # new LoRA modules (their dropout) start in train mode
        self._active = _UNKNOWN
        self._forget_rows()
        self.loads += 1

    def _unload(self, name: str) -> None:
        self._resident.pop(name, None)
        self._delete(name)
        self.evictions += 1

    def _delete(self, name: str) -> None:
        if self.on_delete is not None:
            self.on_delete(name)
        if self._shared is not None:
            # The host's model: its PeftModel stays (the training tenants' adapters live on it).
            self.model.delete_adapter(self.peft_name(name))
        elif list(self.model.peft_config) == [name]:
            # The last one: back to the bare base model (a PeftModel without adapters cannot run).
            self.model.unload()
            self.model = self.base
        else:
            self.model.delete_adapter(name)
        self._active = _UNKNOWN
        self._forget_rows()

    def _forget_rows(self) -> None:
        """The adapters changed: the stacked weights are rebuilt on the next grouped pass."""
        if self._rows is not None:
            self._rows.close()
        self._rows = None
        self._rows_unsupported = False


_UNKNOWN = object()
_MIXED = object()
_ROWS = object()


def _no_resolver(name: str) -> Path:
    raise AdapterNotFound(f"adapter {name!r} not found")
