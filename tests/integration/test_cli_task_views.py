"""`opentinker submit --set`, `get` and `list` against a real scheduler process: `get` shows every
hyper-parameter the task runs with (resolved at submit, defaults included) and `attempt 1 of 3`,
`list` shows the environment and the name, `--set` overrides a value of the file."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

from opentinker_common.spec import GRPOConfig
from tests.support.procs import Cluster


def run(url: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("SCHEDULER_URL", "OPENTINKER_API_KEY")}
    env["COLUMNS"] = "250"
    return subprocess.run(
        [sys.executable, "-m", "opentinker_client", "--scheduler-url", url, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_submit_set_then_get_and_list_show_what_the_task_runs_with(cluster: Cluster, tmp_path) -> None:
    cluster.start_scheduler()  # no trainer: the task stays pending, which is all this needs
    config = tmp_path / "task.yaml"
    config.write_text(
        textwrap.dedent(
            """\
            name: from-file
            workload_type: lora_finetune
            model: /models/m
            env: {env_id: arithmetic, max_digits: 1}
            hyperparameters: {steps: 15}
            """
        )
    )
    sub = run(cluster.url, "submit", str(config), "--set", "hyperparameters.steps=3", "--set", "name=from-cli")
    assert sub.returncode == 0, sub.stderr
    task_id = sub.stdout.strip()

    got = run(cluster.url, "get", task_id)
    assert got.returncode == 0, got.stderr
    rows = {
        line.split()[0]: line.split(None, 1)[1] if len(line.split()) > 1 else "" for line in got.stdout.splitlines()
    }
    assert rows["attempt"].strip() == "1 of 3"
    assert rows["name"].strip() == "from-cli"
    assert rows["steps"].strip() == "3"  # the override, not the file's 15
    for f in dataclasses.fields(GRPOConfig):  # every value used, defaults included
        assert f.name in rows, f.name
    assert float(rows["learning_rate"]) == GRPOConfig().learning_rate

    listed = run(cluster.url, "list")
    assert listed.returncode == 0, listed.stderr
    header, row = listed.stdout.splitlines()[0].split(), listed.stdout.splitlines()[1].split()
    assert header[:5] == ["TASK", "ID", "NAME", "WORKLOAD", "ENV"]
    assert row[:4] == [task_id, "from-cli", "lora_finetune", "arithmetic"]

    bad = run(cluster.url, "submit", str(config), "--set", "hyperparameters.stesp=3")
    assert bad.returncode == 2 and bad.stderr.startswith("error: --set hyperparameters.stesp=3: ")
    assert len(bad.stderr.strip().splitlines()) == 1
    # An empty value is never silently the default; a mapping is set key by key.
    for override, words in (
        ("hyperparameters.steps=", "no value after '='; expected hyperparameters.steps=VALUE, or"),
        ("hyperparameters=3", "expected a key inside it, dotted: hyperparameters.KEY=VALUE"),
    ):
        bad = run(cluster.url, "submit", str(config), "--set", override)
        assert bad.returncode == 2 and bad.stdout == "", bad
        assert bad.stderr.startswith(f"error: --set {override}: ") and words in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1 and "did you mean" not in bad.stderr
    assert len(run(cluster.url, "list").stdout.strip().splitlines()) == 2  # nothing more was submitted
    # A typo'd workload type gets a did-you-mean; a task on the default environment lists it by name.
    bad = run(cluster.url, "submit", str(config), "--set", "workload_type=lora_finetun")
    assert bad.returncode == 2 and bad.stderr.rstrip().endswith("; did you mean 'lora_finetune'? [INVALID_ARGUMENT]")
    plain = tmp_path / "plain.yaml"
    plain.write_text("workload_type: lora_finetune\nmodel: /models/m\n")
    sub = run(cluster.url, "submit", str(plain))
    assert sub.returncode == 0, sub.stderr
    (row,) = [line.split() for line in run(cluster.url, "list").stdout.splitlines() if sub.stdout.strip() in line]
    assert row[3] == "arithmetic", row  # ENV: the default it runs on, not "-"
