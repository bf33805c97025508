"""A task file is checked whole: every bad key is named, each at its line and column, in the
order of the file (``ConfigError.problems``); the CLI prints one ``error:`` line for each, as a
compiler lists its errors. A file with one problem reads as before."""

from __future__ import annotations

import textwrap

import pytest

from opentinker_client import ConfigError, parse_task_config
from opentinker_client.cli.commands import main
from opentinker_client.config import apply_overrides

SEVERAL = textwrap.dedent(
    """\
    workload_type: lora_finetune
    gpu_count: 0
    env:
      env_id: arithmetic
      max_digits: 99
    hyperparameters:
      stesp: 3
      learning_rate: -1
      steps: "5"
    tracking: {tensorboard: relative/dir}
    """
)


def _where(err: ConfigError) -> list[tuple[int | None, int | None, str | None]]:
    return [(p.line, p.column, p.key) for p in err.problems]


def test_every_bad_key_is_named_at_its_line_in_file_order() -> None:
    with pytest.raises(ConfigError) as err:
        parse_task_config(SEVERAL, source="task.yaml")
    assert _where(err.value) == [
        (5, 3, "env.max_digits"),
        (7, 3, "hyperparameters.stesp"),
        (8, 3, "hyperparameters.learning_rate"),
        (9, 3, "hyperparameters.steps"),
        (10, 12, "tracking.tensorboard"),
    ]
    first, *rest = err.value.problems
    assert (err.value.line, err.value.column, err.value.key, err.value.field) == (
        5,
        3,
        "env.max_digits",
        "env.max_digits",
    )
    assert err.value.details.splitlines() == [p.details for p in err.value.problems]
    assert err.value.details.splitlines()[0].startswith("task.yaml:5:3: env.max_digits: expected an integer in [1, ")
    assert "did you mean 'steps'?" in rest[0].details
    assert "that is text (a quoted value): write 5, without quotes" in rest[2].details
    assert all(p.problems == (p,) for p in err.value.problems)  # each stands alone


def test_top_level_problems_are_all_named_too() -> None:
    text = "workload_typ: lora_finetune\ngpu_count: lots\nnodes: 0.5\n"
    with pytest.raises(ConfigError) as err:
        parse_task_config(text, source="t.yaml")
    assert [(p.line, p.key) for p in err.value.problems] == [
        (1, "workload_typ"),
        (1, None),  # the missing workload_type, at the top of the file
        (2, "gpu_count"),
        (3, "nodes"),
    ]
    assert "did you mean 'workload_type'?" in err.value.problems[0].details
    assert "missing workload_type" in err.value.problems[1].details


def test_one_problem_reads_as_before() -> None:
    with pytest.raises(ConfigError) as err:
        parse_task_config("workload_type: lora_finetune\nhyperparameters: {steps: 0}\n", source="t.yaml")
    assert err.value.problems == (err.value,)
    assert err.value.details.startswith("t.yaml:2:19: hyperparameters.steps: expected an integer in [1, ")
    assert "\n" not in err.value.details


def test_overrides_name_each_problem_by_its_override() -> None:
    cfg = parse_task_config("workload_type: lora_finetune\n", source="t.yaml")
    with pytest.raises(ConfigError) as err:
        apply_overrides(cfg, ["hyperparameters.steps=0", "gpu_count=1", "hyperparameters.learning_rate=2"])
    assert [p.source for p in err.value.problems] == [
        "--set hyperparameters.steps=0",
        "--set hyperparameters.learning_rate=2",
    ]


def test_the_cli_prints_a_line_for_each_problem_and_exits_2(capsys, tmp_path) -> None:
    path = tmp_path / "task.yaml"
    path.write_text(SEVERAL)
    code = main(["submit", str(path), "--scheduler-url", "127.0.0.1:1"])
    lines = capsys.readouterr().err.splitlines()
    assert code == 2
    assert [line.split(": ")[1] for line in lines] == [
        f"{path}:{n}:{c}" for n, c in [(5, 3), (7, 3), (8, 3), (9, 3), (10, 12)]
    ]
    assert all(line.startswith("error: ") and line.endswith(" [INVALID_ARGUMENT]") for line in lines)


def test_top_level_problems_do_not_hide_the_other_keys_problems() -> None:
    text = textwrap.dedent(
        """\
        workload_type: lora_finetune
        gpu_count: -1
        colour: blue
        max_attempts: "three"
        env: {env_id: arithmetic, max_digits: 99}
        hyperparameters:
          group_size: true
          learning_rate: -1
        """
    )
    with pytest.raises(ConfigError) as err:
        parse_task_config(text, source="t.yaml")
    assert [(p.line, p.key) for p in err.value.problems] == [
        (2, "gpu_count"),
        (3, "colour"),
        (4, "max_attempts"),
        (5, "env.max_digits"),
        (7, "hyperparameters.group_size"),
        (8, "hyperparameters.learning_rate"),
    ]
    assert "got true" in err.value.problems[4].details  # the file's spelling, not Python's True


def test_a_key_of_the_wrong_type_is_named_once_not_again_through_what_depends_on_it() -> None:
    # `env` is not a mapping: it is named as such, and the spec check of the rest does not add
    # what a missing env would cause (sft: "needs a dataset"), nor judge `env` again.
    text = "workload_type: sft\nenv: chat_jsonl\nhyperparameters: {learning_rate: -1}\n"
    with pytest.raises(ConfigError) as err:
        parse_task_config(text, source="t.yaml")
    assert [(p.line, p.key) for p in err.value.problems] == [(2, "env"), (3, "hyperparameters.learning_rate")]
