"""`opentinker submit --dry-run` resolves and checks a task as `submit` does, against a real
scheduler (in this process, no trainer), and creates nothing: the `dataset:` file relative to the
task file (the word-problems example of docs/usage.md), a missing one refused by both with the path tried and
the task file's own note on how to make it, a reward that cannot score the data, an `init_from`
that does not exist; and the estimate is of one attempt, or says there is none."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from opentinker_client.cli.commands import main
from tests.support.security import LoopbackScheduler

ROOT = Path(__file__).resolve().parents[3]
MAKE = ROOT / "scripts" / "make_word_problems.py"


@pytest.fixture(scope="module")
def scheduler(tmp_path_factory):
    with LoopbackScheduler(tmp_path_factory.mktemp("state"), "default_model: /models/m\n") as s:
        yield s


@pytest.fixture
def example(tmp_path: Path) -> Path:
    """The word-problems example of docs/usage.md laid out as in the repository: examples/ holds the task file."""
    (tmp_path / "examples").mkdir()
    shutil.copy(ROOT / "examples" / "word_problems_numeric.yaml", tmp_path / "examples")
    return tmp_path / "examples" / "word_problems_numeric.yaml"


def cli(capsys, scheduler, *args: str) -> tuple[int, str, str]:
    code = main(["--scheduler-url", scheduler.target, *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def stored(scheduler) -> tuple[int, list[str]]:
    """Tasks in the scheduler's store and files under its datasets folder: what a dry run must not add."""
    datasets = scheduler.config.state_dir / "datasets"
    files = sorted(p.name for p in datasets.rglob("*") if p.is_file()) if datasets.exists() else []
    return len(scheduler.core.store.tasks_in_states(range(1, 8))), files


def test_the_word_problems_example_dry_runs_as_it_submits(capsys, scheduler, example, monkeypatch) -> None:
    monkeypatch.chdir(example.parents[1])  # docs/usage.md's commands run from the repository root
    made = subprocess.run(
        [sys.executable, str(MAKE), "--out", "examples/word_problems.jsonl", "-n", "300"],
        capture_output=True,
        text=True,
    )
    assert made.returncode == 0, made.stderr
    before = stored(scheduler)
    code, out, err = cli(capsys, scheduler, "submit", "examples/word_problems_numeric.yaml", "--dry-run")
    assert code == 0, err
    assert "\nvalid: lora_finetune on /models/m, 0 GPU(s)" in "\n" + out  # (the scheduler logs here too)
    assert "estimate: none (" in out and "attempt(s)" not in out
    assert stored(scheduler) == before  # nothing uploaded, nothing created

    code, out, err = cli(capsys, scheduler, "submit", "examples/word_problems_numeric.yaml")
    assert code == 0, err
    task_id = out.strip().splitlines()[-1]
    task = scheduler.core.api.get(task_id)
    dataset_id = task.spec.env_config.fields["dataset_id"].string_value
    # A dry run names the file by the id the upload gives it (the scheduler now holds those bytes).
    code, _, err = cli(capsys, scheduler, "submit", "examples/word_problems_numeric.yaml", "--dry-run")
    assert code == 0, err
    assert dataset_id.startswith("sha256:") and stored(scheduler)[0] == before[0] + 1


def test_a_missing_dataset_is_refused_alike_naming_the_path_and_how_to_make_it(
    capsys, scheduler, example, monkeypatch
) -> None:
    monkeypatch.chdir(example.parents[1])
    before = stored(scheduler)
    errors = []
    for extra in (["--dry-run"], []):
        code, _, err = cli(capsys, scheduler, "submit", "examples/word_problems_numeric.yaml", *extra)
        assert code == 2
        errors.append(err)
    assert errors[0] == errors[1]  # one check for both
    tried = example.parent / "word_problems.jsonl"
    assert errors[0] == (
        "error: dataset: word_problems.jsonl: no such file (tried "
        f"{tried}; a relative dataset: is read from the folder of examples/word_problems_numeric.yaml "
        f"({example.parent})); examples/word_problems_numeric.yaml says how to make it: "
        ".venv/bin/python scripts/make_word_problems.py --out examples/word_problems.jsonl [INVALID_ARGUMENT]\n"
    )
    assert stored(scheduler) == before


def test_a_reward_that_cannot_score_the_data_is_refused_by_the_dry_run_too(capsys, scheduler, tmp_path) -> None:
    rows = [{"prompt": "What is 1 + 1?", "answer": 2}, {"prompt": "What is two + 1?", "answer": "three"}]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = tmp_path / "task.yaml"
    task.write_text(
        "workload_type: lora_finetune\ndataset: data.jsonl\nenv: {env_id: prompts, reward: {verifier: numeric}}\n"
    )
    before = stored(scheduler)
    for extra in (["--dry-run"], []):
        code, _, err = cli(capsys, scheduler, "submit", str(task), *extra)
        assert code == 2
        assert err.startswith("error: spec.env_config.reward.verifier: expected a reward that fits the dataset")
        assert "line 2: \"answer\": expected a number, got 'three'" in err
    assert stored(scheduler) == before


def test_a_dry_run_checks_references_as_a_submit_does(capsys, scheduler, tmp_path) -> None:
    task = tmp_path / "task.yaml"
    task.write_text("workload_type: lora_finetune\ninit_from: task-nope\n")
    for extra in (["--dry-run"], []):
        code, _, err = cli(capsys, scheduler, "submit", str(task), *extra)
        assert (code, err) == (2, "error: spec.init_from: task 'task-nope' not found [NOT_FOUND]\n")


def test_a_dataset_without_env_feeds_the_workloads_own_environment(capsys, scheduler, tmp_path) -> None:
    # lora_finetune's dataset is prompts (numeric reward by default), not sft's chat examples.
    (tmp_path / "data.jsonl").write_text(json.dumps({"prompt": "What is 1 + 1?", "answer": 2}) + "\n")
    task = tmp_path / "task.yaml"
    task.write_text("workload_type: lora_finetune\ndataset: data.jsonl\n")
    code, out, err = cli(capsys, scheduler, "submit", str(task), "--dry-run")
    assert code == 0, err
    assert "valid: lora_finetune" in out
    code, out, err = cli(capsys, scheduler, "submit", str(task))
    assert code == 0, err
    env = scheduler.core.api.get(out.strip().splitlines()[-1]).spec.env_config.fields
    assert env["env_id"].string_value == "prompts" and env["dataset_id"].string_value.startswith("sha256:")


def test_dataset_mistakes_get_one_line_saying_what_takes_a_dataset(capsys, scheduler, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.jsonl").write_text(json.dumps({"prompt": "What is 1 + 1?", "answer": 2}) + "\n")
    (tmp_path / "arith.yaml").write_text("workload_type: lora_finetune\nenv: {env_id: arithmetic}\n")
    (tmp_path / "serve.yaml").write_text("workload_type: inference\ndataset: data.jsonl\n")
    before = stored(scheduler)
    code, _, err = cli(capsys, scheduler, "submit", "arith.yaml", "--set", "dataset=data.jsonl")
    assert code == 2 and err == (
        "error: --set dataset=data.jsonl: dataset: expected env.env_id prompts with a dataset file (env_id "
        "'arithmetic' reads none: a dataset is prompts for lora_finetune and full_rl, chat examples for sft); set "
        "env.env_id: prompts (scored by env.reward) or leave the dataset out [INVALID_ARGUMENT]\n"
    )
    code, _, err = cli(capsys, scheduler, "submit", "serve.yaml")
    assert code == 2 and err == (
        "error: serve.yaml:2:1: dataset: expected no dataset file for inference (one is read by sft (chat_jsonl) or "
        "lora_finetune (prompts) or full_rl (prompts) only); leave it out [INVALID_ARGUMENT]\n"
    )
    # A --set path is read from the current folder, and the error says the one it tried.
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "task.yaml").write_text("workload_type: lora_finetune\n")
    code, _, err = cli(capsys, scheduler, "submit", "sub/task.yaml", "--set", "dataset=nothere.jsonl", "--dry-run")
    assert code == 2 and err == (
        f"error: dataset: {tmp_path / 'nothere.jsonl'}: no such file (tried {tmp_path / 'nothere.jsonl'}) "
        "[INVALID_ARGUMENT]\n"
    )
    assert stored(scheduler) == before


def test_a_dry_run_notes_a_model_folder_that_is_not_on_this_machine(capsys, scheduler, tmp_path) -> None:
    task = tmp_path / "task.yaml"
    task.write_text("workload_type: lora_finetune\nmodel: /models/not-here\n")
    code, out, err = cli(capsys, scheduler, "submit", str(task), "--dry-run")
    assert code == 0 and "valid: lora_finetune on /models/not-here" in out, err
    note = [line for line in err.splitlines() if line.startswith("note: ")]
    assert note == [
        "note: model '/models/not-here' is a folder that is not on this machine; the dry run cannot check the "
        "trainer nodes' disks: it must be there (else the task fails as it starts: no such folder on this trainer "
        "node)"
    ]
    # A folder that is here, and a hub id, get no note.
    for model in (str(tmp_path), "HuggingFaceTB/SmolLM2-135M-Instruct"):
        task.write_text(f"workload_type: lora_finetune\nmodel: {model}\n")
        code, out, err = cli(capsys, scheduler, "submit", str(task), "--dry-run")
        assert code == 0 and "note: " not in err, err


def test_a_template_that_set_completes_is_taken_and_one_it_does_not_names_the_file(
    capsys, scheduler, tmp_path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.jsonl").write_text(json.dumps({"prompt": "What is 1 + 1?", "answer": 2}) + "\n")
    # The file alone is refused (a prompts env names no data); --set dataset= completes it.
    (tmp_path / "template.yaml").write_text("workload_type: lora_finetune\nenv:\n  env_id: prompts\n")
    code, _, err = cli(capsys, scheduler, "submit", "template.yaml")
    assert code == 2 and err.startswith("error: template.yaml:2:1: env.dataset_id: expected exactly one of"), err
    code, out, err = cli(capsys, scheduler, "submit", "template.yaml", "--set", "dataset=data.jsonl", "--dry-run")
    assert code == 0 and "valid: lora_finetune" in out, err
    # Overrides that do not complete it: the file's own error, with its line and column.
    code, _, err = cli(capsys, scheduler, "submit", "template.yaml", "--set", "gpu_count=0", "--dry-run")
    assert code == 2 and err.startswith("error: template.yaml:2:1: env.dataset_id: expected exactly one of"), err


def test_a_dry_run_says_what_submit_would_face_on_the_nodes_connected_now(capsys, tmp_path) -> None:
    """The pool names a 4-GPU node, but the trainer that joined under its id has no GPU: a
    2-GPU task would wait, and the dry run says why; a CPU task would start at once."""
    from tests.support.scheduler_core import register

    config = "default_model: /models/m\nresource_pool:\n  - {node_id: gpu-node-01, gpu_count: 4, max_tasks: 8}\n"
    with LoopbackScheduler(tmp_path / "state", config) as s:
        s.do(register, s.core, "gpu-node-01", 0)
        task = tmp_path / "task.yaml"
        task.write_text("workload_type: lora_finetune\ngpu_count: 2\n")
        code, out, err = cli(capsys, s, "submit", str(task), "--dry-run")
        assert code == 0, err
        assert "would wait now: no connected node has 2 GPU(s); the largest is gpu-node-01 with 0" in out, out
        task.write_text("workload_type: lora_finetune\ngpu_count: 0\n")
        code, out, err = cli(capsys, s, "submit", str(task), "--dry-run")
        assert code == 0 and "would wait" not in out, out


def test_a_dry_run_notes_a_dataset_path_that_is_not_on_this_machine(capsys, scheduler, tmp_path) -> None:
    task = tmp_path / "task.yaml"
    task.write_text("workload_type: sft\nenv:\n  env_id: chat_jsonl\n  path: /data/not-here.jsonl\n")
    code, out, err = cli(capsys, scheduler, "submit", str(task), "--dry-run")
    assert code == 0, err
    assert "note: env.path '/data/not-here.jsonl' is not on this machine" in err
