"""The ``paths:`` policy: which local model folders and dataset files a spec may name.

Pure checks (hub ids, folders, the config section) and the refusals through a real scheduler on
loopback with auth on and off: INVALID_ARGUMENT naming the field and what is allowed, nothing
stored.
"""

from __future__ import annotations

import os

import grpc
import pytest
from google.protobuf import struct_pb2
from hypothesis import given, settings, strategies as st

from opentinker.common.v1 import common_pb2 as C
from opentinker.scheduler.v1 import scheduler_pb2 as S, scheduler_pb2_grpc
from opentinker_client import InvalidArgumentError, RLClient
from opentinker_scheduler.config import ConfigError, parse_config
from opentinker_scheduler.errors import InvalidArgument
from opentinker_scheduler.admission.paths import PathsConfig, check_local_paths, is_hub_id, is_under

from tests.support.security import LoopbackScheduler, metadata

# ----------------------------------------------------------------------------------- pure checks


@pytest.mark.parametrize(
    "name", ["gpt2", "HuggingFaceTB/SmolLM2-135M-Instruct", "Qwen/Qwen2.5-0.5B", "org/na.me_1-x", "a/b"]
)
def test_hub_ids(name: str) -> None:
    assert is_hub_id(name)


@pytest.mark.parametrize(
    "name",
    [
        "/models/m",
        "./m",
        "../m",
        "..",
        ".",
        "a/b/c",
        "runs/t/checkpoints",
        "~/m",
        "~alice/m",
        "a//b",
        "a/",
        "/",
        "org/.hidden",
        "org/..",
        ".a",
        "",
        "a b",
    ],
)
def test_not_hub_ids(name: str) -> None:
    assert not is_hub_id(name)


@pytest.mark.parametrize(
    ("path", "ok"),
    [
        ("/models/m", True),
        ("/models", True),
        ("/models/a/b", True),
        ("/models2/m", False),  # a text prefix is not a folder
        ("/models/../srv/runs", False),
        ("/models/./m", False),
        ("/models//m", False),
        ("/models/m/", False),
        ("//models/m", False),
        ("models/m", False),
        ("/models/m\x00x", False),
        ("/srv/m", False),
    ],
)
def test_is_under(path: str, ok: bool) -> None:
    assert is_under(path, ("/models",)) is ok


def _spec(model: str = "", data: str | None = None, workload: str = "lora_finetune") -> C.TaskSpec:
    spec = C.TaskSpec(workload_type=workload, model=model, resources=C.Resources(gpu_count=0))
    if data is not None:
        spec.env_config.CopyFrom(struct_pb2.Struct())
        spec.env_config.update({"env_id": "chat_jsonl", "path": data})
    return spec


def test_unset_lists_allow_anything_with_auth_off_and_no_local_path_with_auth_on() -> None:
    open_ = PathsConfig()
    check_local_paths(_spec("/anywhere/step_1", "/etc/passwd", "sft"), paths=open_, auth_enabled=False)
    with pytest.raises(
        InvalidArgument,
        match=r"spec.model: expected a hub id \(org/name\) or no local path "
        r"\(auth is on and paths.model_dirs lists no folder\), got '/models/m'",
    ):
        check_local_paths(_spec("/models/m"), paths=open_, auth_enabled=True)
    with pytest.raises(
        InvalidArgument,
        match=r"spec.env_config.path: expected an uploaded dataset_id \(upload_dataset\) or no local path",
    ):
        check_local_paths(_spec("org/m", "/data/x.jsonl", "sft"), paths=open_, auth_enabled=True)
    check_local_paths(_spec("HuggingFaceTB/SmolLM2-135M-Instruct"), paths=open_, auth_enabled=True)


def test_listed_folders_restrict_even_with_auth_off() -> None:
    paths = PathsConfig(model_dirs=("/models",), data_dirs=("/data",))
    check_local_paths(_spec("/models/m", "/data/d/x.jsonl", "sft"), paths=paths, auth_enabled=False)
    with pytest.raises(
        InvalidArgument,
        match=r"spec.model: expected a hub id \(org/name\) or a folder under paths.model_dirs \(/models\), "
        r"got '/srv/runs/t1/checkpoints/step_1'",
    ):
        check_local_paths(_spec("/srv/runs/t1/checkpoints/step_1"), paths=paths, auth_enabled=False)
    with pytest.raises(
        InvalidArgument,
        match=r"spec.env_config.path: .* a file under paths.data_dirs \(/data\), got '/srv/runs/datasets/ab.jsonl'",
    ):
        check_local_paths(_spec("/models/m", "/srv/runs/datasets/ab.jsonl", "sft"), paths=paths, auth_enabled=False)
    # [] = no local paths at all, whatever auth says.
    with pytest.raises(InvalidArgument, match="spec.model"):
        check_local_paths(_spec("/models/m"), paths=PathsConfig(model_dirs=()), auth_enabled=False)


@pytest.mark.parametrize(
    ("model", "why"),
    [
        ("/models/../srv/runs/t1/checkpoints/step_1", "normalized"),
        ("/models/./m", "normalized"),
        ("models/m/x", "must be absolute"),
        ("../models/m", "must be absolute"),
        ("~/m", "must be absolute"),
    ],
)
def test_dot_dot_and_relative_paths_are_refused_with_the_reason(model: str, why: str) -> None:
    with pytest.raises(InvalidArgument, match=f"spec.model: .*got '{model}'.*{why}"):
        check_local_paths(_spec(model), paths=PathsConfig(model_dirs=("/models",)), auth_enabled=True)


def test_default_model_is_the_operators_and_exempt() -> None:
    paths = PathsConfig(model_dirs=("/models",))
    check_local_paths(_spec(""), paths=paths, auth_enabled=True, default_model="/opt/base")
    check_local_paths(_spec("/opt/base"), paths=paths, auth_enabled=True, default_model="/opt/base")
    with pytest.raises(InvalidArgument, match="spec.model"):
        check_local_paths(_spec("/opt/base/../other"), paths=paths, auth_enabled=True, default_model="/opt/base")


_PIECES = st.sampled_from(
    ["/", "models", "..", ".", "m", "srv", "runs", "~", "a.b", "-x", "//", "\x00", "models2", " "]
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_PIECES, max_size=8).map("".join) | st.text(max_size=40))
def test_any_accepted_model_is_a_hub_id_or_really_under_model_dirs(model: str) -> None:
    try:
        check_local_paths(_spec(model), paths=PathsConfig(model_dirs=("/models",)), auth_enabled=True)
    except InvalidArgument as exc:
        assert str(exc).startswith(
            (
                "spec.model: expected a hub id (org/name) or a folder under paths.model_dirs (/models), got ",
                "spec.model: expected text on one line without control characters, got U+",
            )
        )
        return
    if model and not is_hub_id(model):
        real = os.path.normpath(model)
        assert real == model and (real == "/models" or real.startswith("/models/")) and ".." not in real.split("/")


# ------------------------------------------------------------------------------------ config


def test_paths_section_parses() -> None:
    cfg = parse_config("paths:\n  model_dirs: [/models, /srv/models]\n  data_dirs: [/data]\n", "x.yaml")
    assert cfg.paths == PathsConfig(model_dirs=("/models", "/srv/models"), data_dirs=("/data",))
    assert parse_config("paths: {model_dirs: []}\n").paths == PathsConfig(model_dirs=(), data_dirs=None)
    assert parse_config("lease: 10\n").paths == PathsConfig()


@pytest.mark.parametrize(
    ("text", "where"),
    [
        (
            "paths:\n  model_dirs: [models]\n",
            "x.yaml:2:16: paths.model_dirs[0]: expected an absolute, normalized folder such as /models, got 'models'",
        ),
        (
            "paths:\n  data_dirs: [/data/]\n",
            "x.yaml:2:15: paths.data_dirs[0]: expected an absolute, normalized folder such as /data, got '/data/'",
        ),
        (
            "paths:\n  data_dirs:\n    - /data/../etc\n",
            "x.yaml:3:7: paths.data_dirs[0]: expected an absolute, normalized folder",
        ),
        ("paths:\n  model_dirs: /models\n", "x.yaml:2:15: paths.model_dirs: expected a list"),
        (
            "paths:\n  model_dir: [/models]\n",
            "x.yaml:2:3: paths.model_dir: expected one of the known keys (data_dirs, model_dirs, tracking_dirs)",
        ),
        ("paths: [/models]\n", "x.yaml:1:8: paths: expected a mapping"),
        ("paths:\n  model_dirs: [1]\n", "x.yaml:2:16: paths.model_dirs[0]: expected a string"),
    ],
)
def test_bad_paths_sections_name_file_line_and_key(text: str, where: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(text, "x.yaml")
    assert str(err.value).startswith(where)


# ------------------------------------------------------------------------- a real scheduler


def _users(s: LoopbackScheduler) -> str:
    admin = s.admin_key
    with RLClient(s.target, api_key=admin) as root:
        return root.keys.create("bob", "user")[1]


def _submit(s: LoopbackScheduler, key: str | None, spec: C.TaskSpec) -> tuple[grpc.StatusCode, str]:
    with s.channel() as ch:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
        md = metadata(key) if key else ()
        try:
            stub.SubmitTask(S.SubmitTaskRequest(spec=spec), metadata=md)
        except grpc.RpcError as err:
            return err.code(), err.details()
        return grpc.StatusCode.OK, ""


def _count(s: LoopbackScheduler) -> int:
    return s.do(lambda: sum(s.core.store.count_by_state().values()))


def test_auth_on_with_model_dirs_refuses_other_folders_and_stores_nothing(tmp_path) -> None:
    s = LoopbackScheduler(
        tmp_path / "state", "auth: {enabled: true}\npaths: {model_dirs: [/models], data_dirs: [/data]}\n"
    )
    try:
        bob = _users(s)
        refused = {
            # Another owner's full-weights checkpoint on the trainer node.
            "/srv/runs/2f1c/checkpoints/step_1": "got '/srv/runs/2f1c/checkpoints/step_1'",
            "/models/../srv/runs/2f1c/checkpoints/step_1": "normalized",
            "runs/2f1c/checkpoints/step_1": "must be absolute",
        }
        for model, why in refused.items():
            code, details = _submit(s, bob, _spec(model))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (model, details)
            assert (
                details.startswith(
                    "spec.model: expected a hub id (org/name) or a folder under paths.model_dirs (/models)"
                )
                and why in details
            )
        code, details = _submit(s, bob, _spec("/models/m", "/srv/runs/datasets/" + "a" * 64 + ".jsonl", "sft"))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(
            "spec.env_config.path: expected an uploaded dataset_id"
        )
        assert "paths.data_dirs (/data)" in details
        assert _count(s) == 0  # nothing half-written
        # Allowed: a hub id, a folder under model_dirs, a file under data_dirs.
        for spec in (
            _spec("HuggingFaceTB/SmolLM2-135M-Instruct"),
            _spec("/models/m"),
            _spec("/models/m", "/data/chat.jsonl", "sft"),
        ):
            assert _submit(s, bob, spec) == (grpc.StatusCode.OK, "")
        assert _count(s) == 3
        # The typed client error carries the same words.
        with RLClient(s.target, api_key=bob) as c:
            with pytest.raises(InvalidArgumentError, match="spec.model: expected a hub id"):
                c.submit_task(workload_type="inference", model="/srv/runs/2f1c/checkpoints/step_1")
    finally:
        s.close()


def test_auth_on_without_paths_allows_hub_ids_only(tmp_path) -> None:
    s = LoopbackScheduler(tmp_path / "state", "auth: {enabled: true}\n", default_model="/opt/base-model")
    try:
        bob = _users(s)
        code, details = _submit(s, bob, _spec("/models/m"))
        assert (
            code == grpc.StatusCode.INVALID_ARGUMENT
            and "no local path (auth is on and paths.model_dirs lists no folder)" in details
        )
        code, details = _submit(s, bob, _spec("org/m", "/data/chat.jsonl", "sft"))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("spec.env_config.path")
        assert _submit(s, bob, _spec("org/m")) == (grpc.StatusCode.OK, "")
        assert _submit(s, bob, _spec("")) == (grpc.StatusCode.OK, "")  # the operator's default_model
    finally:
        s.close()


def test_auth_off_is_unrestricted(tmp_path) -> None:
    s = LoopbackScheduler(tmp_path / "state")
    try:
        for spec in (
            _spec("/anywhere/runs/t/checkpoints/step_1"),
            _spec("relative/model/dir"),
            _spec("/m", "/any/file.jsonl", "sft"),
        ):
            assert _submit(s, None, spec) == (grpc.StatusCode.OK, "")
    finally:
        s.close()


def _tracked(tracking: dict) -> C.TaskSpec:
    spec = _spec("org/m")
    spec.tracking.update(tracking)
    return spec


def test_tracking_folders_must_lie_under_paths_tracking_dirs() -> None:
    paths = PathsConfig(tracking_dirs=("/runs",))
    check_local_paths(
        _tracked({"tensorboard": "/runs/tb", "mlflow": {"uri": "file:///runs/mlruns"}}), paths=paths, auth_enabled=True
    )
    check_local_paths(_tracked({"mlflow": {"uri": "http://mlflow:5000"}}), paths=paths, auth_enabled=True)
    with pytest.raises(
        InvalidArgument,
        match=r"spec.tracking.tensorboard: expected a folder under paths.tracking_dirs \(/runs\), got '/home/x/tb'",
    ):
        check_local_paths(_tracked({"tensorboard": "/home/x/tb"}), paths=paths, auth_enabled=False)
    with pytest.raises(InvalidArgument, match=r"spec.tracking.mlflow.uri: expected no local path \(auth is on"):
        check_local_paths(_tracked({"mlflow": {"uri": "file:///tmp/m"}}), paths=PathsConfig(), auth_enabled=True)
    check_local_paths(_tracked({"tensorboard": "/anywhere"}), paths=PathsConfig(), auth_enabled=False)
