"""`scripts/bench_ppo.py` smoke runs: two tiny updates per seed, the summary over seeds, the SB3
peer skipped with a message when no interpreter is given, and the peer's JSON read back (from a
stand-in interpreter: stable-baselines3 is not in the project's venv). No timing is asserted:
BENCHMARKS.md has the figures."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = ["--only", "cartpole", "--seeds", "1,2", "--set", "total_timesteps=512", "--set", "update_epochs=1"]


def bench(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_ppo.py"), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_without_a_peer_interpreter_the_peer_is_skipped_and_ours_is_summarised() -> None:
    out = bench(*TINY)
    assert "SB3 peer skipped: no --peer-python given" in out
    assert out.count("   ours       seed") == 2
    summary = [line for line in out.splitlines() if line.startswith("cartpole ")]
    assert len(summary) == 1 and "not reached" in summary[0]  # 475 is not reached in 512 steps
    assert "ours/SB3" not in out


def test_the_peers_json_is_read_and_the_ratio_printed(tmp_path: Path) -> None:
    fake = tmp_path / "python"
    line = {"seed": 1, "hit_steps": 256, "hit_s": 0.5, "steps": 512, "wall_s": 1.0, "random": 20.0, "final": 480.0}
    line |= {"sb3": "fake", "torch": "fake"}
    fake.write_text(f"#!/bin/sh\necho '{json.dumps(line)}'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = bench(*TINY, "--set", "clip_vloss=true", "--peer-python", str(fake))
    assert out.count("   SB3        seed") == 2
    assert "SB3 (sb3-zoo-cartpole)" in out and "256, 256" in out
    # ours never reaches 475 here, so the steps ratio is not a number; the time ratio is printed
    assert "ours/SB3 cartpole: median steps to 475 nanx" in out and "(stable-baselines3 fake, torch fake)" in out
    assert '"clip_vloss": true' in out  # --set reached our runs
