"""A benchmark's result as one JSON file: the source of a row of BENCHMARKS.md.

A bench script calls ``write_result`` once per comparison it measured. The file goes to
``$BENCH_RESULTS_DIR/<name>.json``; the ``make bench-*`` targets set that folder to
``benchmarks/results``, and without it nothing is written, so test runs of a script leave the
checked-in results alone. ``make bench-report`` renders BENCHMARKS.md from the folder
(``scripts/bench_report.py``).

Each file holds: ``name``, ``what`` (the quantity), ``peer`` (what it is compared with),
``ratios`` (each with a ``label`` saying which side is divided by which and a ``value``),
``goal``, ``settings``, ``make`` (the target that reproduces it), ``command`` (this run's
argv), ``date`` (UTC), ``machine`` (the hardware and its load), ``notes`` and ``details``.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
from pathlib import Path

#: The environment variable naming the folder results go to; unset, nothing is written.
RESULTS_DIR_ENV = "BENCH_RESULTS_DIR"

_START_LOAD = os.getloadavg()[0]


def machine() -> dict:
    """The hardware, the software that matters for timings, and the load average now and at start."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3
    versions = {"python": platform.python_version()}
    for module in ("torch", "grpc", "transformers"):
        mod = sys.modules.get(module)
        if mod is not None:
            versions[module] = getattr(mod, "__version__", "?")
    cores = os.cpu_count() or 0
    loads = (_START_LOAD, os.getloadavg()[0])
    return {
        "cpu": cpu,
        "cores": cores,
        "memory_gib": round(mem_gib, 1),
        "os": f"{platform.system()} {platform.release()}",
        "versions": versions,
        "load_average": [round(x, 2) for x in loads],
        "shared": max(loads) > 0.5 * cores,
    }


def write_result(
    name: str,
    *,
    what: str,
    peer: str,
    ratios: list[dict],
    make: str,
    goal: str = "",
    settings: dict | None = None,
    notes: str = "",
    details: dict | None = None,
) -> Path | None:
    """Write ``<name>.json`` into ``$BENCH_RESULTS_DIR``; return its path, or None when unset.

    ``ratios``: ``[{"label": "tokens/s, ours / transformers CB, 4 streams", "value": 1.02}]``;
    a value of None means the side could not be measured in this run. A figure that is not a
    ratio names its unit: ``{"label": ..., "value": 0.4, "unit": " s"}``.
    """
    folder = os.environ.get(RESULTS_DIR_ENV)
    if not folder:
        return None
    out = {
        "name": name,
        "what": what,
        "peer": peer,
        "ratios": ratios,
        "goal": goal,
        "settings": settings or {},
        "make": make,
        "command": shlex.join(["python", *_repo_relative(sys.argv)]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "notes": notes,
        "details": details or {},
    }
    path = Path(folder) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(f"result written to {path}", flush=True)
    return path


def _repo_relative(argv: list[str]) -> list[str]:
    root = Path(__file__).resolve().parent.parent
    out = []
    for arg in argv:
        try:
            out.append(str(Path(arg).resolve().relative_to(root)) if Path(arg).exists() else arg)
        except ValueError:
            out.append(arg)
    return out
