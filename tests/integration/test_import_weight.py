"""What an import loads, each in a fresh interpreter: the client needs neither torch nor rich,
the trainer's table of workloads needs no torch, and the shared layer and the scheduler load no
client module."""

from __future__ import annotations

import subprocess
import sys


def loaded_after(statement: str, *prefixes: str) -> list[str]:
    """The modules starting with one of ``prefixes`` that a fresh interpreter holds after ``statement``."""
    code = (
        f"{statement}\n"
        "import sys\n"
        f"print('\\n'.join(sorted(m for m in sys.modules if m.split('.')[0] in {prefixes!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120)
    return out.stdout.split()


def test_importing_the_client_loads_neither_torch_nor_rich() -> None:
    code = (
        "import opentinker_client, sys; "
        "assert 'torch' not in sys.modules, 'torch'; assert 'rich' not in sys.modules, 'rich'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_inference_client_and_evaluate_load_no_torch() -> None:
    code = (
        "import sys, opentinker_client.inference\n"
        "from opentinker_client.evaluate import evaluate\n"
        "from opentinker_client.inference import Generation, Sample\n"
        "class C:\n"
        "    adapter = None\n"
        "    def generate(self, **kw): return Generation((Sample(0, '1', (), (), 'stop'),), 1, 1, 'm', None)\n"
        "evaluate(C(), episodes=2)\n"
        "assert 'torch' not in sys.modules, 'torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_table_of_workloads_loads_no_torch() -> None:
    assert loaded_after("from opentinker_trainer.workloads import TRAINERS", "torch", "transformers", "peft") == []


def test_the_shared_tls_module_loads_no_client_module() -> None:
    assert loaded_after("import opentinker_common.net.tls", "opentinker_client") == []


def test_the_scheduler_server_loads_no_client_module() -> None:
    assert loaded_after("import opentinker_scheduler.server", "opentinker_client") == []


def test_the_check_sees_what_an_import_loads() -> None:
    """The helper above would say ``[]`` for a broken command too: this shows it sees a load."""
    assert "opentinker_client" in loaded_after("import opentinker_client", "opentinker_client")
