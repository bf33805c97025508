"""The import rules in pyproject.toml bite: ``lint-imports`` (what ``make lint`` runs) passes on
this tree, and on a copy of the packages with one deliberate bad import it exits non-zero naming
the contract that import breaks, while the other contracts stay kept."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
PACKAGES = (
    "opentinker_common",
    "opentinker_client",
    "opentinker_scheduler",
    "opentinker_trainer",
    "opentinker_gateway",
    "protos/opentinker",
)

ROLES_INDEPENDENT = "The four roles never import each other (only opentinker_common and the stubs)"
SHARED_LAYER_IMPORTS_NO_ROLE = "The shared layer and the stubs import no role"
POLICY_IS_PURE = "Scheduler policy is pure: no gRPC, no store, no other scheduler room"
NO_TORCH = "The client, the gateway and the shared layer need no torch"
RL_IS_PURE = "RL math is pure: no gRPC in opentinker_trainer.rl"
SCHEDULER_LAYERS = "Scheduler rooms in layers: api over admission over security/data over state over policy"
CORE_PARTS = "The scheduler core's parts never import the core (no import cycle through state/core.py)"
STATE_ACYCLIC = "The scheduler state's modules import each other without cycles"


def contract_names() -> list[str]:
    with open(REPO / "pyproject.toml", "rb") as f:
        return [c["name"] for c in tomllib.load(f)["tool"]["importlinter"]["contracts"]]


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    if not LINT_IMPORTS.exists():
        pytest.skip(f"{LINT_IMPORTS} is not installed (make install puts it in .venv/bin with the dev extra)")
    # COLUMNS: lint-imports wraps its report at the terminal's width (80 without one), which
    # would split long contract names and "(l.N)" line numbers from the lines read below.
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{root / 'protos'}", "COLUMNS": "1000"}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--no-logo"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def verdicts(proc: subprocess.CompletedProcess) -> dict[str, str]:
    """Contract name -> "KEPT" or "BROKEN", from the summary lines ``lint-imports`` prints."""
    out: dict[str, str] = {}
    for line in proc.stdout.splitlines():
        for name in contract_names():
            if line.startswith(name + " "):
                out[name] = line[len(name) :].split()[0]
    return out


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """The five packages, the stubs and pyproject.toml, copied as they are in this tree."""
    for package in PACKAGES:
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def append_import(root: Path, module: str, statement: str) -> None:
    path = root / module
    path.write_text(path.read_text() + f"\n{statement}  # a deliberate bad import\n")


def test_the_contracts_are_the_ones_these_tests_break() -> None:
    assert set(contract_names()) == {
        ROLES_INDEPENDENT,
        SHARED_LAYER_IMPORTS_NO_ROLE,
        NO_TORCH,
        POLICY_IS_PURE,
        RL_IS_PURE,
        SCHEDULER_LAYERS,
        CORE_PARTS,
        STATE_ACYCLIC,
    }


def test_lint_imports_passes_on_this_tree() -> None:
    proc = lint_imports(REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert verdicts(proc) == {name: "KEPT" for name in contract_names()}, proc.stdout


def test_lint_imports_passes_on_an_unchanged_copy(copy: Path) -> None:
    """The copy alone is a faithful tree: what fails below fails because of the one import added."""
    proc = lint_imports(copy)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert verdicts(proc) == {name: "KEPT" for name in contract_names()}, proc.stdout


@pytest.mark.parametrize(
    "module, statement, imported, broken",
    [
        ("opentinker_scheduler/state/core.py", "import opentinker_client", "opentinker_client", ROLES_INDEPENDENT),
        ("opentinker_gateway/app.py", "import opentinker_scheduler", "opentinker_scheduler", ROLES_INDEPENDENT),
        ("opentinker_gateway/wire.py", "import torch", "torch", NO_TORCH),
        ("opentinker_scheduler/policy/placement.py", "import grpc", "grpc", POLICY_IS_PURE),
        ("opentinker_common/logs.py", "import opentinker_trainer", "opentinker_trainer", SHARED_LAYER_IMPORTS_NO_ROLE),
        ("opentinker_common/spec/task.py", "import torch", "torch", NO_TORCH),
        ("opentinker_trainer/rl/gae.py", "import grpc", "grpc", RL_IS_PURE),
        (
            "opentinker_scheduler/state/core.py",
            "from opentinker_scheduler.api import service",
            "opentinker_scheduler.api.service",
            SCHEDULER_LAYERS,
        ),
        (
            "opentinker_scheduler/state/gangs.py",
            "from opentinker_scheduler.state import core",
            "opentinker_scheduler.state.core",
            CORE_PARTS,
        ),
    ],
    ids=[
        "scheduler-imports-client",
        "gateway-imports-scheduler",
        "gateway-imports-torch",
        "policy-imports-grpc",
        "shared-layer-imports-trainer",
        "shared-layer-imports-torch",
        "rl-imports-grpc",
        "state-imports-api",
        "gangs-imports-core",
    ],
)
def test_one_bad_import_breaks_the_contract_it_names(
    copy: Path, module: str, statement: str, imported: str, broken: str
) -> None:
    append_import(copy, module, statement)
    proc = lint_imports(copy)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    seen = verdicts(proc)
    assert seen[broken] == "BROKEN", proc.stdout
    importer = module.removesuffix(".py").replace("/", ".")
    assert f"{importer} -> {imported}" in proc.stdout, proc.stdout  # the report names the import
    expected = [broken]
    if broken == CORE_PARTS:  # the core imports every part, so a part importing it is a cycle too
        expected.append(STATE_ACYCLIC)
    if broken != SHARED_LAYER_IMPORTS_NO_ROLE:  # the shared layer importing a role reaches the roles too
        assert [name for name, verdict in seen.items() if verdict == "BROKEN"] == expected, proc.stdout


@pytest.mark.parametrize(
    "module, statement, cycle",
    [
        (
            "opentinker_scheduler/state/store.py",
            "from opentinker_scheduler.state import pg_store",
            ".store -> .pg_store",
        ),
        ("opentinker_scheduler/state/ledger.py", "from opentinker_scheduler.state import gangs", ".ledger -> .gangs"),
    ],
    ids=["store-imports-pg-store", "ledger-imports-gangs"],
)
def test_an_import_cycle_between_state_modules_breaks_the_acyclic_contract(
    copy: Path, module: str, statement: str, cycle: str
) -> None:
    append_import(copy, module, statement)
    proc = lint_imports(copy)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    seen = verdicts(proc)
    assert [name for name, verdict in seen.items() if verdict == "BROKEN"] == [STATE_ACYCLIC], proc.stdout
    assert cycle in proc.stdout, proc.stdout  # the report names the import that closes the cycle
