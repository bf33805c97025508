"""What a trained task's checkpoint becomes on the user's machine: a merged transformers model, a
PPO policy that acts, and the episodes that policy plays.

Needs the ``models`` extra (``pip install 'opentinker[models]'``: torch, transformers, peft,
gymnasium); the client itself stays torch-free, so each function imports them when called and
raises :class:`MissingExtraError` naming the extra when they are not installed.

* :func:`merge_adapter` — a LoRA adapter folder (PEFT format, as ``download_checkpoint`` writes
  it) merged into its base model with PEFT's ``merge_and_unload`` and saved as a plain
  transformers folder (``from_pretrained`` loads it with no PEFT), in bfloat16 or float32.
* :func:`load_policy` — the TorchScript acting policy of a ``torch_ppo`` checkpoint
  (``policy.torchscript.pt``: observations ``[B, *obs_shape]`` in, ``(action, value)`` out).
* :func:`evaluate_policy` — mean episode return of such a policy on a gymnasium environment, with
  its standard error.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

__all__ = [
    "ACTING_FILE",
    "MERGE_DTYPES",
    "MERGE_LOGITS_RTOL",
    "MissingExtraError",
    "PolicyEvalResult",
    "evaluate_policy",
    "load_policy",
    "merge_adapter",
]

#: The TorchScript acting policy in a ``torch_ppo`` checkpoint folder (written by the trainer).
ACTING_FILE = "policy.torchscript.pt"
#: Weight types :func:`merge_adapter` writes.
MERGE_DTYPES = ("bfloat16", "float32")
#: How far (relative to the largest logit) the merged model's float32 logits may be from the
#: adapter-wrapped model's on :func:`merge_adapter`'s probe before the merge is refused.
MERGE_LOGITS_RTOL = 1e-3
#: Most episodes one :func:`evaluate_policy` call plays.
MAX_EPISODES = 10_000


class MissingExtraError(RuntimeError):
    """An optional dependency is not installed; the message names the extra to install."""


def _need(*modules: str) -> None:
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtraError(
            f"this needs {', '.join(missing)}, not installed here: pip install 'opentinker[models]'"
        )


def merge_adapter(
    adapter_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    base: str | None = None,
    dtype: str = "bfloat16",
) -> Path:
    """Merge the LoRA adapter in ``adapter_dir`` into its base model and save the result to ``out_dir``.

    The base weights are loaded in float32 and the adapter merged there (``W + B A * alpha / r``,
    PEFT's ``merge_and_unload``), then cast to ``dtype``, so a bfloat16 result is rounded once,
    not merged in bfloat16. Before anything is written the merge is checked: the merged float32
    model's logits on a probe of 16 token ids must be those of the base with the adapter applied,
    within :data:`MERGE_LOGITS_RTOL` of the largest logit. The tokenizer comes from ``adapter_dir``
    when it has one, else from the base. The folder is written beside ``out_dir`` and renamed into
    place: a failed merge leaves nothing.

    Args:
        adapter_dir: a PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``).
        out_dir: the folder to create (must not exist, or be empty).
        base: the base model, a hub id or a local folder; default: the adapter's
            ``base_model_name_or_path`` (the model the task named).
        dtype: ``bfloat16`` or ``float32``.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        MissingExtraError: torch, transformers or peft is not installed.
        ValueError: a bad ``dtype``, ``adapter_dir`` is not a PEFT LoRA adapter folder, or the
            merged model's logits are not the adapter's (the message gives both figures).
        FileExistsError: ``out_dir`` exists and is not empty.
        OSError: the base model cannot be loaded (transformers' error, naming it).
    """
    if dtype not in MERGE_DTYPES:
        raise ValueError(f"dtype: expected one of {', '.join(MERGE_DTYPES)}, got {dtype!r}")
    adapter_dir, out = Path(adapter_dir), Path(out_dir)
    config_file = adapter_dir / "adapter_config.json"
    if not config_file.is_file() or not (adapter_dir / "adapter_model.safetensors").is_file():
        raise ValueError(
            f"{adapter_dir}: expected a PEFT LoRA adapter folder (adapter_config.json and "
            "adapter_model.safetensors); a full-weight (hf_full) checkpoint needs no merging"
        )
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty folder")
    _need("torch", "transformers", "peft")
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = base or json.loads(config_file.read_text()).get("base_model_name_or_path") or ""
    if not base:
        raise ValueError(f"{config_file}: names no base model (base_model_name_or_path); pass base=")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    wrapped = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    vocab = int(model.get_input_embeddings().num_embeddings)
    probe = torch.linspace(0, vocab - 1, 16).long().unsqueeze(0)  # token ids across the vocabulary
    with torch.no_grad():
        want = wrapped(probe).logits.float()
        merged = wrapped.merge_and_unload().eval()
        got = merged(probe).logits.float()
    off, scale = float((got - want).abs().max()), float(want.abs().max())
    if not off <= MERGE_LOGITS_RTOL * max(scale, 1e-6):
        raise ValueError(
            f"the merged model's logits differ from the adapter's by up to {off:.3g} (largest logit {scale:.3g}, "
            f"tolerance {MERGE_LOGITS_RTOL:g} of it): the merge is wrong, nothing was written"
        )
    merged = merged.to(getattr(torch, dtype))
    has_tokenizer = (adapter_dir / "tokenizer_config.json").is_file()
    tokenizer = AutoTokenizer.from_pretrained(str(adapter_dir) if has_tokenizer else base)
    tmp = out.with_name(f".{out.name}.part-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        merged.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_policy(checkpoint_dir: str | os.PathLike[str]):
    """The TorchScript acting policy of a ``torch_ppo`` checkpoint folder (``torch.jit.load``).

    Called as ``action, value = policy(obs)``: ``obs`` ``[B, *obs_shape]`` (a ``Discrete``
    observation: ``[B]`` integers), ``action`` the greedy action ``env.step`` takes (``[B]`` int64
    or ``[B, *action_shape]`` float32, clipped to the space), ``value`` the critic's ``V(s)`` ``[B]``.

    Raises:
        MissingExtraError: torch is not installed.
        FileNotFoundError: the folder has no ``policy.torchscript.pt`` (not a single-agent PPO
            checkpoint, or one written before policies were exported).
    """
    path = Path(checkpoint_dir) / ACTING_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{checkpoint_dir} has no {ACTING_FILE}: expected a torch_ppo checkpoint of a single-agent full_rl task"
        )
    _need("torch")
    import warnings

    import torch

    with warnings.catch_warnings():  # torch 2.13 marks TorchScript deprecated; it loads and runs as before
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.load(str(path), map_location="cpu").eval()


@dataclass(frozen=True)
class PolicyEvalResult:
    """Episodes a policy played (:func:`evaluate_policy`).

    Attributes:
        env_id: the gymnasium id.
        episodes: how many.
        mean_return: mean undiscounted episode return.
        stderr: standard error of that mean, ``std / sqrt(episodes)`` with the sample standard
            deviation (``ddof=1``; 0 for one episode): ``mean ± stderr`` is about a 68 % interval
            for the policy's true mean return, ``mean ± 2 stderr`` about 95 %.
        returns, lengths: per episode, in order.
    """

    env_id: str
    episodes: int
    mean_return: float
    stderr: float
    returns: tuple[float, ...]
    lengths: tuple[int, ...]


def mean_and_stderr(values: list[float]) -> tuple[float, float]:
    """``(mean, standard error of the mean)`` of ``values`` (sample std, ``ddof=1``; 0 for one value)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def evaluate_policy(
    policy: Any,
    env_id: str,
    *,
    episodes: int = 32,
    seed: int = 0,
    env_kwargs: Mapping[str, Any] | None = None,
    max_episode_steps: int | None = None,
) -> PolicyEvalResult:
    """Play ``episodes`` episodes of ``gymnasium.make(env_id, **env_kwargs)`` with ``policy``
    (:func:`load_policy`'s, or any callable ``obs [1, ...] -> (action [1, ...], value [1])``),
    acting greedily; episode ``i`` is reset with seed ``seed + i``, so two policies evaluated
    with the same seed meet the same starts.

    Raises:
        MissingExtraError: torch or gymnasium is not installed.
        ValueError: ``episodes`` outside 1..10000; gymnasium cannot make ``env_id``.
    """
    if not 1 <= episodes <= MAX_EPISODES:
        raise ValueError(f"episodes: expected 1..{MAX_EPISODES}, got {episodes}")
    _need("torch", "gymnasium")
    import gymnasium
    import numpy as np
    import torch

    kwargs = dict(env_kwargs or {})
    if max_episode_steps is not None:
        kwargs["max_episode_steps"] = max_episode_steps
    try:
        env = gymnasium.make(env_id, **kwargs)
    except Exception as exc:  # noqa: BLE001 - gymnasium raises several error types for unknown ids
        raise ValueError(f"env_id {env_id!r}: gymnasium cannot make it here ({type(exc).__name__}: {exc})") from None
    returns, lengths = [], []
    try:
        with torch.no_grad():
            for i in range(episodes):
                obs, _ = env.reset(seed=seed + i)
                total, steps, done = 0.0, 0, False
                while not done:
                    action, _value = policy(torch.as_tensor(np.asarray(obs))[None])
                    act = action[0].numpy()
                    obs, reward, terminated, truncated, _ = env.step(act.item() if act.ndim == 0 else act)
                    total += float(reward)
                    steps += 1
                    done = bool(terminated or truncated)
                returns.append(total)
                lengths.append(steps)
    finally:
        env.close()
    mean, stderr = mean_and_stderr(returns)
    return PolicyEvalResult(env_id, episodes, mean, stderr, tuple(returns), tuple(lengths))
