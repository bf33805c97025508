"""Spec of sft (chat datasets, SFTConfig), full_rl on text (FullGRPOConfig) and init_from."""

from __future__ import annotations

import dataclasses
import json

import pytest

from opentinker.common.v1 import common_pb2
from opentinker_client.config import parse_task_config
from opentinker_client.errors import ConfigError
from opentinker_common.spec import (
    ChatDatasetConfig,
    DatasetError,
    FullGRPOConfig,
    GRPOConfig,
    SFTConfig,
    SpecError,
    TaskSpecModel,
    spec_from_proto,
)
from opentinker_common.spec.sft import parse_chat_line, validate_chat_lines

DATASET_ID = "sha256:" + "ab" * 32


def line(*messages, **extra) -> str:
    return json.dumps({"messages": [{"role": r, "content": c} for r, c in messages], **extra})


GOOD = line(("system", "Be brief."), ("user", "What is 2 + 3?"), ("assistant", "5"))


def test_good_lines_parse_and_blank_lines_are_skipped() -> None:
    assert parse_chat_line(GOOD, 1) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "5"},
    ]
    assert (
        parse_chat_line(line(("user", "hi"), ("assistant", "hello"), id=7, source="x").encode(), 1) is not None
    )  # other keys ignored
    assert parse_chat_line("   ", 4) is None
    assert validate_chat_lines([GOOD, "", GOOD.encode(), "\t"]) == 2


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("{not json", "a JSON object such as"),
        ("[1, 2]", 'a JSON object with a "messages" list'),
        ('{"msgs": []}', 'a non-empty "messages" list'),
        ('{"messages": []}', 'a non-empty "messages" list'),
        ('{"messages": ["hi"]}', "messages[0] to be an object"),
        (
            '{"messages": [{"role": "user", "content": "a", "name": "bob"}]}',
            'messages[0] to have only "role" and "content"',
        ),
        (line(("user", "a"), ("robot", "b")), "messages[1].role to be one of system, user, assistant"),
        (line(("user", "a"), ("system", "b"), ("assistant", "c")), '"system" only as the first message'),
        (
            '{"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]}',
            "messages[0].content to be a string",
        ),
        (line(("user", "a"), ("user", "b")), "at least one assistant message with non-empty content"),
        (line(("user", "a"), ("assistant", "")), "at least one assistant message with non-empty content"),
        (line(("system", "s"), ("assistant", "b"), ("user", "c")), 'a "user" message before the first "assistant" one'),
    ],
)
def test_bad_line_names_its_number_and_what_was_expected(text: str, expected: str) -> None:
    with pytest.raises(DatasetError) as err:
        validate_chat_lines([GOOD, "", text])
    assert err.value.line == 3
    assert str(err.value).startswith("line 3: expected ")
    assert expected in str(err.value)


def test_non_utf8_and_empty_datasets_are_refused() -> None:
    with pytest.raises(DatasetError, match=r"line 2: expected UTF-8 text"):
        validate_chat_lines([GOOD.encode(), b"\xff\xfe"])
    with pytest.raises(DatasetError, match=r"dataset: expected at least one example \(the dataset is empty\)") as err:
        validate_chat_lines(["", "  "])
    assert err.value.line == 0
    with pytest.raises(DatasetError, match="dataset: expected at least one example"):
        validate_chat_lines([])


def sft_spec(env=None, hp=None, **kw) -> TaskSpecModel:
    return TaskSpecModel.from_parts(
        workload_type="sft",
        model="/m",
        env_config=env if env is not None else {"env_id": "chat_jsonl", "dataset_id": DATASET_ID},
        hyperparameters=hp or {},
        **kw,
    )


def test_sft_spec_defaults_and_kinds() -> None:
    model = sft_spec()
    assert isinstance(model.env, ChatDatasetConfig) and model.env.dataset_id == DATASET_ID and model.env.path is None
    assert model.env.eval_fraction == 0.1 and model.env.max_seq_len == 512
    hp = model.hyperparameters
    assert isinstance(hp, SFTConfig) and hp.lora and hp.steps == 0 and hp.epochs == 1 and hp.lr_schedule == "constant"
    assert (
        sft_spec(env={"env_id": "chat_jsonl", "path": "/data/train.jsonl"}, hp={"lora": False}).hyperparameters.lora
        is False
    )


@pytest.mark.parametrize(
    ("env", "hp", "field", "expected"),
    [
        ({"env_id": "chat_jsonl"}, {}, "spec.env_config.dataset_id", "exactly one of dataset_id"),
        (
            {"env_id": "chat_jsonl", "dataset_id": DATASET_ID, "path": "/a.jsonl"},
            {},
            "spec.env_config.dataset_id",
            "exactly one of",
        ),
        (
            {"env_id": "chat_jsonl", "dataset_id": "sha256:XYZ"},
            {},
            "spec.env_config.dataset_id",
            "sha256:<64 lowercase hex digits>",
        ),
        ({"env_id": "chat_jsonl", "path": "data/train.jsonl"}, {}, "spec.env_config.path", "an absolute path"),
        (
            {"env_id": "chat_jsonl", "path": "/a", "eval_fraction": 0.95},
            {},
            "spec.env_config.eval_fraction",
            "a number in [0.0, 0.9]",
        ),
        (
            {"env_id": "chat_jsonl", "path": "/a", "max_seq_len": 4},
            {},
            "spec.env_config.max_seq_len",
            "an integer in [8",
        ),
        (None, {"batch_size": 0}, "spec.hyperparameters.batch_size", "an integer in [1"),
        (None, {"lr_schedule": "step"}, "spec.hyperparameters.lr_schedule", "one of constant, linear, cosine"),
        (None, {"lora": True, "target_modules": []}, "spec.hyperparameters.target_modules", "at least one module name"),
        (None, {"group_size": 4}, "spec.hyperparameters.group_size", "one of the known keys"),
        ({"env_id": "arithmetic"}, {}, "spec.env_config.env_id", "expected a dataset: sft trains on chat examples"),
    ],
)
def test_bad_sft_specs_name_the_field(env, hp, field: str, expected: str) -> None:
    with pytest.raises(SpecError) as err:
        sft_spec(env=env, hp=hp)
    assert err.value.field == field
    assert expected in str(err.value)


def test_full_grpo_config_is_grpo_without_lora_fields() -> None:
    names = {f.name for f in dataclasses.fields(FullGRPOConfig)}
    assert names == {f.name for f in dataclasses.fields(GRPOConfig)} - {
        "lora_rank",
        "lora_alpha",
        "lora_dropout",
        "target_modules",
    }
    model = TaskSpecModel.from_parts(
        workload_type="full_rl",
        model="/m",
        env_config={"env_id": "arithmetic"},
        hyperparameters={"steps": 2, "kl_coef": 0.1},
    )
    assert isinstance(model.hyperparameters, FullGRPOConfig)
    assert model.hyperparameters.learning_rate == 1e-5 and model.hyperparameters.kl_coef == 0.1
    with pytest.raises(SpecError) as err:
        TaskSpecModel.from_parts(workload_type="full_rl", model="/m", env_config={}, hyperparameters={"lora_rank": 8})
    assert err.value.field == "spec.hyperparameters.lora_rank"
    with pytest.raises(SpecError, match=r"spec.hyperparameters.learning_rate: expected a number in \(0.0, 1.0\]"):
        TaskSpecModel.from_parts(
            workload_type="full_rl", model="/m", env_config={}, hyperparameters={"learning_rate": 0}
        )


def test_init_from_travels_through_the_proto_and_is_checked() -> None:
    spec = common_pb2.TaskSpec(workload_type="lora_finetune", model="/m", init_from="task-0192f3c4d5e6f7a8b9c")
    assert spec_from_proto(spec).init_from == "task-0192f3c4d5e6f7a8b9c"
    assert sft_spec(init_from="task-1").init_from == "task-1"  # sft may continue an earlier sft
    with pytest.raises(SpecError) as err:
        spec_from_proto(common_pb2.TaskSpec(workload_type="lora_finetune", model="/m", init_from="../etc/passwd"))
    assert err.value.field == "spec.init_from"
    with pytest.raises(
        SpecError,
        match="spec.init_from: expected empty: starting from another task's checkpoint works for language-model "
        "workloads",
    ) as err:
        TaskSpecModel.from_parts(
            workload_type="full_rl",
            model="/m",
            env_config={"env_id": "CartPole-v1"},
            hyperparameters={},
            init_from="task-1",
        )


def test_task_yaml_carries_init_from_with_line_numbers() -> None:
    cfg = parse_task_config("workload_type: lora_finetune\ninit_from: task-0192f3c4d5e6f7a8b9c\n")
    assert cfg.init_from == "task-0192f3c4d5e6f7a8b9c"
    assert cfg.to_proto().init_from == "task-0192f3c4d5e6f7a8b9c"
    with pytest.raises(ConfigError) as err:
        parse_task_config("workload_type: lora_finetune\n\ninit_from: 'a b'\n", source="t.yaml")
    assert err.value.line == 3 and "init_from" in str(err.value)
    with pytest.raises(ConfigError) as err:
        parse_task_config("workload_type: lora_finetune\ninit_from: 5\n", source="t.yaml")
    assert err.value.line == 2


def test_task_yaml_dataset_is_a_file_beside_it_checked_with_a_stand_in_id(tmp_path) -> None:
    from opentinker_client.config import load_task_config

    cfg_file = tmp_path / "sft.yaml"
    cfg_file.write_text(
        "workload_type: sft\ndataset: data/train.jsonl\nenv: {eval_fraction: 0.2}\nhyperparameters: {steps: 3}\n"
    )
    cfg = load_task_config(cfg_file)
    assert cfg.dataset == str(tmp_path / "data" / "train.jsonl")
    model = cfg.check()
    assert (
        model.env.env_id == "chat_jsonl"
        and model.env.eval_fraction == 0.2
        and model.env.dataset_id == "sha256:" + "0" * 64
    )
    assert parse_task_config("workload_type: sft\ndataset: /abs/t.jsonl\n").dataset == "/abs/t.jsonl"
    cfg_file.write_text("workload_type: sft\ndataset: t.jsonl\nenv:\n  env_id: chat_jsonl\n  path: /data/t.jsonl\n")
    with pytest.raises(ConfigError) as err:
        load_task_config(cfg_file)
    assert err.value.line == 3 and "nothing here when `dataset` names a file to upload" in str(err.value)
