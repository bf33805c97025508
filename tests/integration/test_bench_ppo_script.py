"""`scripts/bench_ppo.py` smoke runs: two tiny updates per seed, the summary over seeds, the SB3
peer skipped with a message when no interpreter is given, the peer's JSON read back (from a
stand-in interpreter: stable-baselines3 is not in the project's venv), and the result file with
each side in a session of its own. No timing is asserted: BENCHMARKS.md has the figures."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = ["--only", "cartpole", "--seeds", "1,2", "--set", "total_timesteps=512", "--set", "update_epochs=1"]


def bench(*args: str, env: dict | None = None) -> str:
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_ppo.py"), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
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


def test_the_result_file_records_per_seed_steps_and_a_session_per_side_in_alternating_order(tmp_path: Path) -> None:
    fake = tmp_path / "python"
    # The stand-in peer reports the session it runs in, as scripts/peer_sb3_ppo.py does.
    fake.write_text(
        "#!/bin/sh\nsid=$(ps -o sid= -p $$ | tr -d ' ')\n"
        'echo "{\\"seed\\": 1, \\"hit_steps\\": 256, \\"hit_s\\": 0.5, \\"steps\\": 512, \\"wall_s\\": 1.0, '
        '\\"random\\": 20.0, \\"final\\": 480.0, \\"sb3\\": \\"fake\\", \\"torch\\": \\"fake\\", '
        '\\"session\\": $sid}"\n'
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    results = tmp_path / "results"
    bench(*TINY, "--peer-python", str(fake), env={**os.environ, "BENCH_RESULTS_DIR": str(results)})
    record = json.loads((results / "ppo-sb3-cartpole.json").read_text())
    assert record["make"] == "make bench-ppo-sb3" and record["settings"]["seeds"] == [1, 2]
    assert [r["label"].split(",")[0] for r in record["ratios"]] == [
        "median env steps to 475",
        "seconds per 1000 env steps",
    ]
    details = record["details"]
    assert details["ours_steps_per_seed"] == {"1": None, "2": None}  # 475 is not reached in 512 steps
    assert details["order"] == ["ours first on seed 1", "SB3 first on seed 2"]
    sessions = details["sessions"]
    mine = {sessions["bench"], *sessions["ours"], *sessions["sb3"]}
    assert len(mine) == 5, sessions  # the bench, each of our runs and each peer run: a session each
    assert record["machine"]["cores"] >= 1 and record["date"].endswith("UTC")
