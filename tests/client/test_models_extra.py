"""The `models` extra stays optional: importing the client and its CLI loads no torch,
transformers or peft (opentinker_client.models imports them only when called)."""

import subprocess
import sys


def test_client_and_cli_import_without_torch() -> None:
    code = (
        "import sys, opentinker_client, opentinker_client.cli.commands, opentinker_client.models;"
        "print(sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stderr
