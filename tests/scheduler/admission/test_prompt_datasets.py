"""Prompt datasets at upload and submit: lines checked as the format uploaded, the dataset's format
matched to the environment, the reward checked against a sample of lines (with line numbers).
A real core, store and dataset folder; no gRPC."""

from __future__ import annotations

import asyncio
import json

import pytest
from google.protobuf import struct_pb2

from opentinker.common.v1 import common_pb2 as C
from opentinker.scheduler.v1 import scheduler_pb2 as S
from opentinker_scheduler.admission.admit import admit
from opentinker_scheduler.config.paths import PathsConfig
from opentinker_scheduler.data.datasets import DatasetStore, receive_upload
from opentinker_scheduler.errors import InvalidArgument
from opentinker_scheduler.security.keys import Principal

from tests.support.scheduler_core import make_core, spec

ALICE = Principal("alice", "user", key_prefix="otk_0000aaaa")
PROMPTS = b"".join(
    json.dumps(x).encode() + b"\n"
    for x in (
        {"prompt": "2+2?", "answer": 4},
        {"prompt": "3+3?", "answer": "six"},
        {"prompt": "4+4?"},
        {"prompt": "5+5?", "answer": 10},
    )
)
CHAT = b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n'


def upload(store: DatasetStore, data: bytes, fmt: str = "") -> S.DatasetInfo:
    async def requests():
        yield S.UploadDatasetRequest(name="d.jsonl", total_bytes=len(data), chunk=data, format=fmt)

    return asyncio.run(receive_upload(store, requests()))


@pytest.fixture
def env(tmp_path):
    core = make_core(tmp_path, paths=PathsConfig(model_dirs=("/models",)))
    yield core, DatasetStore(tmp_path / "datasets")
    core.store.close()


def prompts_spec(dataset_id: str, **reward) -> C.TaskSpec:
    s = spec()
    e = struct_pb2.Struct()
    e.update({"env_id": "prompts", "dataset_id": dataset_id, "reward": reward or {"verifier": "numeric"}})
    s.env_config.CopyFrom(e)
    return s


def submit(core, datasets, s):
    return asyncio.run(admit(s, ALICE, core=core, datasets=datasets))


def test_lines_are_checked_as_the_format_uploaded(tmp_path) -> None:
    store = DatasetStore(tmp_path / "d")
    info = upload(store, PROMPTS, "prompts")
    assert (info.num_examples, info.format) == (4, "prompts")
    with pytest.raises(InvalidArgument, match=r"dataset d.jsonl:1: expected a non-empty \"messages\" list"):
        upload(store, PROMPTS)  # as chat: a prompt line is no sft example
    with pytest.raises(InvalidArgument, match=r'dataset d.jsonl:2: expected a "prompt" \(text\) or "messages"'):
        upload(store, PROMPTS.replace(b'"prompt": "3+3?"', b'"question": "3+3?"'), "prompts")
    with pytest.raises(InvalidArgument, match="format: expected one of chat, prompts"):
        upload(store, PROMPTS, "csv")
    assert list((tmp_path / "d").glob("upload-*")) == []  # nothing half-written left


def test_the_same_bytes_uploaded_in_both_formats_are_stored_once_and_usable_as_either(tmp_path) -> None:
    store = DatasetStore(tmp_path / "d")
    both = b'{"messages": [{"role": "user", "content": "hi"}], "answer": 1}\n'
    with pytest.raises(InvalidArgument):
        upload(store, both)  # no assistant reply: not chat
    chat_and_prompts = CHAT.replace(b'"hello"}]', b'"hello"}, {"role": "user", "content": "again"}]')
    a = upload(store, chat_and_prompts)
    b = upload(store, chat_and_prompts, "prompts")
    assert a.dataset_id == b.dataset_id and store.formats(a.dataset_id) == ["chat", "prompts"]
    assert len(list((tmp_path / "d").glob("*.jsonl"))) == 1


def test_a_verifier_that_does_not_fit_the_data_is_refused_naming_the_lines(env) -> None:
    core, datasets = env
    info = upload(datasets, PROMPTS, "prompts")
    with pytest.raises(InvalidArgument) as err:
        submit(core, datasets, prompts_spec(info.dataset_id))
    msg = str(err.value)
    assert msg.startswith("spec.env_config.reward.verifier: expected a reward that fits the dataset")
    assert "cannot score 2 of the first 4 prompts" in msg
    assert "line 2: \"answer\": expected a number, got 'six'" in msg and 'line 3: no "answer" field' in msg
    assert core.store.count_tasks(owner="alice", states=(C.TASK_STATE_PENDING,)) == 0


def test_a_fitting_reward_is_admitted_and_an_unknown_verifier_lists_the_known_ones(env) -> None:
    core, datasets = env
    info = upload(datasets, PROMPTS.replace(b'"six"', b'"6"').replace(b'"4+4?"}', b'"4+4?", "answer": 8}'), "prompts")
    row = submit(core, datasets, prompts_spec(info.dataset_id))
    assert row.spec.env_config.fields["reward"].struct_value.fields["verifier"].string_value == "numeric"
    with pytest.raises(InvalidArgument) as err:
        submit(core, datasets, prompts_spec(info.dataset_id, verifier="llm_judge"))
    assert str(err.value) == (
        "spec.env_config.reward.verifier: expected one of exact, numeric, choice, regex, json_schema, client, "
        "got 'llm_judge'"
    )


def test_the_dataset_must_have_the_format_the_environment_reads(env) -> None:
    core, datasets = env
    chat = upload(datasets, CHAT)
    with pytest.raises(InvalidArgument, match="expected a dataset uploaded as prompts for env_id prompts, got one"):
        submit(core, datasets, prompts_spec(chat.dataset_id))
    prompts = upload(datasets, PROMPTS, "prompts")
    s = spec()
    e = struct_pb2.Struct()
    e.update({"env_id": "chat_jsonl", "dataset_id": prompts.dataset_id})
    s.env_config.CopyFrom(e)
    s.workload_type = "sft"
    with pytest.raises(InvalidArgument, match="expected a dataset uploaded as chat for env_id chat_jsonl"):
        submit(core, datasets, s)
