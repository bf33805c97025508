"""BENCHMARKS.md is generated: `scripts/bench_report.py` renders it from the benchmarks' own result
files, `benchmarks/results/*.json`, written by `scripts/bench_result.py`. The checked-in page is
what the checked-in results render to, one page with the headline table on its first screen."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
REPORT = REPO / "scripts" / "bench_report.py"


def report(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPORT), *args], cwd=REPO, capture_output=True, text=True, timeout=60, check=False
    )


def test_the_checked_in_page_is_what_the_checked_in_results_render_to() -> None:
    proc = report("--check")
    assert proc.returncode == 0, proc.stderr


def test_the_page_is_one_screen_of_headline_then_method_and_notes_under_250_lines() -> None:
    lines = (REPO / "BENCHMARKS.md").read_text().splitlines()
    assert len(lines) < 250
    head = lines.index("| what | peer | ratio | goal | command | date | machine |")
    assert head < 10
    rows = [line for line in lines[head + 2 :] if line.startswith("|")]
    results = sorted((REPO / "benchmarks" / "results").glob("*.json"))
    assert len(rows) == len(results) >= 10  # a row per result file, every comparison published
    makefile = (REPO / "Makefile").read_text()
    for path in results:
        record = json.loads(path.read_text())
        target = record["make"].split()[1]
        assert re.search(rf"^{re.escape(target)}:", makefile, re.M), f"{path.name}: no make target {target}"
        if record["ratios"]:
            assert record["date"] and record["machine"] and record["command"], path.name
        else:
            assert record.get("status"), f"{path.name}: a row with no ratio says why"
    for row in rows:
        numbers = re.findall(r"\*\*([0-9.]+)(?:x| s)\*\*", row)  # a ratio, or seconds
        assert numbers or "not re-measured" in row, row


def test_a_dropped_result_file_becomes_a_row_and_a_bad_one_is_refused_naming_the_field(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    env = {**os.environ, "BENCH_RESULTS_DIR": str(results)}
    code = (
        "import sys; sys.path.insert(0, 'scripts'); from bench_result import write_result; "
        "write_result('flush-mode', what='B1 submits/s', peer='SQLite', "
        "ratios=[{'label': 'submits/s, PostgreSQL / SQLite', 'value': 0.81}], make='make bench-backends')"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, check=True, timeout=60)
    page, readme = tmp_path / "BENCHMARKS.md", tmp_path / "README.md"
    readme.write_text("# Intro\n\n<!-- bench-report:start -->\nold\n<!-- bench-report:end -->\n\n## Next\n")
    pages = ("--results", str(results), "--out", str(page), "--readme", str(readme))
    assert report(*pages).returncode == 0
    text = page.read_text()
    assert "| [B1 submits/s](#flush-mode) | SQLite | **0.81x** submits/s, PostgreSQL / SQLite |" in text
    assert "### flush-mode" in text and "To add a comparison" in text
    assert "| [B1 submits/s](BENCHMARKS.md#flush-mode) | SQLite | **0.81x**" in readme.read_text()
    assert "old" not in readme.read_text() and readme.read_text().endswith("## Next\n")
    assert report(*pages, "--check").returncode == 0

    (results / "broken.json").write_text(json.dumps({"name": "broken", "what": "x", "peer": "y"}))
    proc = report(*pages)
    assert proc.returncode == 2
    assert "broken.json: missing field(s) ratios, make" in proc.stderr


def test_without_a_results_folder_a_bench_writes_nothing(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "BENCH_RESULTS_DIR"}
    code = (
        "import sys; sys.path.insert(0, 'scripts'); from bench_result import write_result; "
        "print(write_result('x', what='w', peer='p', ratios=[], make='make bench-store'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, check=True, timeout=60, text=True, capture_output=True
    )
    assert out.stdout.strip() == "None"
