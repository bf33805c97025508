"""``make gpu-check`` refuses clearly on a machine without an NVIDIA GPU (this one)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_refuses_without_a_gpu() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: run `make gpu-check` itself")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py")], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2, proc.stderr
    assert "gpu-check: refused: this check needs an NVIDIA GPU" in proc.stderr
    assert "sees no CUDA device" in proc.stderr
