"""What a real scheduler with auth on refuses before any work: control characters in a spec's
names and free text, a cancel reason and an API key's description (INVALID_ARGUMENT naming the
field, word for word the client's own local check for a spec), a request protobuf cannot parse
(a ``Struct`` nested past protobuf's depth limit: INVALID_ARGUMENT saying what to change, never
UNKNOWN naming ``DecodeError``), and ``ListNodes`` from a user key (admins only: it names every
owner's running tasks)."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf.internal.encoder import _VarintBytes
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from opentinker.common.v1 import common_pb2
from opentinker.scheduler.v1 import scheduler_pb2 as S
from opentinker.scheduler.v1 import scheduler_pb2_grpc
from opentinker_client import InvalidArgumentError, PermissionDeniedError, RLClient

from tests.support.security import LoopbackScheduler, metadata


@pytest.fixture(scope="module")
def sched(tmp_path_factory):
    with LoopbackScheduler(tmp_path_factory.mktemp("checks") / "state", "auth: {enabled: true}\n") as s:
        with RLClient(s.target, api_key=s.admin_key) as root:
            s.user_key = root.keys.create("alice", "user")[1]
        yield s


def _submit(sched, spec: common_pb2.TaskSpec) -> grpc.RpcError:
    with grpc.insecure_channel(sched.target) as ch:
        with pytest.raises(grpc.RpcError) as info:
            scheduler_pb2_grpc.SchedulerServiceStub(ch).SubmitTask(
                S.SubmitTaskRequest(spec=spec), metadata=metadata(sched.user_key), timeout=30
            )
    return info.value


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (
            "name",
            "\x1b]0;PWNED\x07\x1b[31mRED\x1b[0m",
            "spec.name: expected text on one line without control characters, got U+001B (ESC) at character 0",
        ),
        (
            "name",
            "ok\ntask-0000 RUNNING forged",
            "spec.name: expected text on one line without control characters, got U+000A (newline) at character 2",
        ),
        (
            "name",
            "abc\u202edef",
            "spec.name: expected text on one line without control characters, got U+202E "
            "(RIGHT-TO-LEFT OVERRIDE) at character 3",
        ),
        (
            "model",
            "org/m\x07",
            "spec.model: expected text on one line without control characters, got U+0007 (BEL) at character 5",
        ),
        (
            "system_prompt",
            "Answer with a number.\n\x1b[2J",
            "spec.env_config.system_prompt: expected text without control characters (newlines and tabs allowed), "
            "got U+001B (ESC) at character 22",
        ),
    ],
)
def test_control_characters_are_refused_at_submit_naming_the_field(sched, field, value, message) -> None:
    fields = {"workload_type": "lora_finetune", "model": "org/m", "name": "t", "env_config": {}}
    if field == "system_prompt":
        fields["env_config"] = {"env_id": "arithmetic", "system_prompt": value}
    else:
        fields[field] = value
    spec = common_pb2.TaskSpec(workload_type=fields["workload_type"], model=fields["model"], name=fields["name"])
    spec.env_config.update(fields["env_config"])
    err = _submit(sched, spec)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details() == message
    (detail,) = rpc_status.from_call(err).details
    bad = error_details_pb2.BadRequest()
    assert detail.Unpack(bad) and bad.field_violations[0].field == message.split(":", 1)[0]

    # The client's local check (the same opentinker_common.spec code) gives the same words.
    with RLClient(sched.target, api_key=sched.user_key) as alice:
        with pytest.raises(InvalidArgumentError) as local:
            alice.submit_task(
                workload_type="lora_finetune",
                model=fields["model"],
                name=fields["name"],
                env_config=fields["env_config"] or None,
            )
        assert message in str(local.value)
        assert local.value.field == message.split(":", 1)[0]
        assert alice.list_tasks() == []  # nothing was stored


def test_multiline_free_text_keeps_newlines_and_tabs(sched) -> None:
    with RLClient(sched.target, api_key=sched.user_key) as alice:
        task_id = alice.submit_task(
            workload_type="lora_finetune",
            model="org/m",
            name="ok",
            env_config={"env_id": "arithmetic", "system_prompt": "Add the numbers.\n\tReply with digits only."},
        )
        assert alice.get_task(task_id).env_config["system_prompt"] == "Add the numbers.\n\tReply with digits only."
        alice.cancel(task_id)


@pytest.mark.parametrize(
    ("struct", "values", "message"),
    [
        (
            "hyperparameters",
            {"learning_rate": float("nan")},
            "spec.hyperparameters.learning_rate: expected a finite number, got nan",
        ),
        (
            "hyperparameters",
            {"kl_coef": float("inf")},
            "spec.hyperparameters.kl_coef: expected a finite number, got inf",
        ),
        (
            "env_config",
            {"env_id": "arithmetic", "max_digits": float("-inf")},
            "spec.env_config.max_digits: expected a finite number, got -inf",
        ),
        (
            "env_config",
            {"env_id": "arithmetic", "reward": {"weights": [1.0, float("nan")]}},
            "spec.env_config.reward.weights[1]: expected a finite number, got nan",
        ),
    ],
)
def test_nan_or_infinity_in_a_spec_is_invalid_argument_naming_the_field(sched, struct, values, message) -> None:
    spec = common_pb2.TaskSpec(workload_type="lora_finetune", model="org/m", name="t")
    getattr(spec, struct).update(values)
    with RLClient(sched.target, api_key=sched.user_key) as alice:
        before = alice.list_tasks()
    for dry_run in (True, False):
        with grpc.insecure_channel(sched.target) as ch:
            with pytest.raises(grpc.RpcError) as info:
                scheduler_pb2_grpc.SchedulerServiceStub(ch).SubmitTask(
                    S.SubmitTaskRequest(spec=spec, dry_run=dry_run), metadata=metadata(sched.user_key), timeout=30
                )
        err = info.value
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
        assert err.details() == message
        (detail,) = rpc_status.from_call(err).details
        bad = error_details_pb2.BadRequest()
        assert detail.Unpack(bad) and bad.field_violations[0].field == message.split(":", 1)[0]
    with RLClient(sched.target, api_key=sched.user_key) as alice:
        assert alice.list_tasks() == before  # nothing was stored


@pytest.mark.parametrize(
    ("reward", "field", "why"),
    [
        ({"verifier": "regex", "options": {"pattern": r"(a)\1"}}, "options.pattern", r"invalid escape sequence: \1"),
        (
            {"verifier": "numeric", "terms": [{"kind": "format", "weight": 0.1, "pattern": r"(?<=x)y"}]},
            "terms[0].pattern",
            "invalid perl operator: (?<=",
        ),
        (
            {"verifier": "json_schema", "options": {"schema": {"type": "string", "pattern": "a(?=b)"}}},
            "options.schema",
            "invalid perl operator: (?=",
        ),
    ],
)
def test_a_reward_pattern_without_a_linear_time_match_is_refused_at_submit(sched, tmp_path, reward, field, why) -> None:
    lines = tmp_path / "prompts.jsonl"
    lines.write_text('{"prompt": "2+2?", "answer": 4}\n{"prompt": "3+3?", "answer": 6}\n')
    with RLClient(sched.target, api_key=sched.user_key) as alice:
        dataset_id = alice.upload_dataset(lines, format="prompts").dataset_id
        before = alice.list_tasks()
    spec = common_pb2.TaskSpec(workload_type="lora_finetune", model="org/m", name="t")
    spec.env_config.update({"env_id": "prompts", "dataset_id": dataset_id, "reward": reward})
    err = _submit(sched, spec)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert err.details().startswith(
        f"spec.env_config.reward.{field}: expected a regular expression RE2 can match in linear time "
        "(no backreferences or lookaround), got "
    )
    assert err.details().endswith(f"({why})")
    with RLClient(sched.target, api_key=sched.user_key) as alice:
        assert alice.list_tasks() == before


def _ld(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return _VarintBytes(number << 3 | 2) + _VarintBytes(len(payload)) + payload


def _deep_struct(levels: int) -> bytes:
    """A ``google.protobuf.Struct`` ``{"a": {"a": ... }}`` nested ``levels`` deep, as bytes (the
    Python protobuf runtime refuses to build one this deep, a hostile client need not)."""
    data = b""
    for _ in range(levels):
        data = _ld(1, _ld(1, b"a") + _ld(2, _ld(5, data)))  # Struct.fields entry {key, Value.struct_value}
    return data


def test_an_over_deep_struct_is_invalid_argument_saying_what_to_change(sched) -> None:
    hp_field = common_pb2.TaskSpec.DESCRIPTOR.fields_by_name["hyperparameters"].number
    spec = common_pb2.TaskSpec(workload_type="lora_finetune", model="org/m").SerializeToString()
    request = _ld(S.SubmitTaskRequest.DESCRIPTOR.fields_by_name["spec"].number, spec + _ld(hp_field, _deep_struct(200)))
    with grpc.insecure_channel(sched.target) as ch:
        submit = ch.unary_unary(
            "/opentinker.scheduler.v1.SchedulerService/SubmitTask",
            request_serializer=lambda b: b,
            response_deserializer=S.SubmitTaskResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as info:
            submit(request, metadata=metadata(sched.user_key), timeout=30)
        err = info.value
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.details() == (
            "request: expected a SubmitTask request nested at most 100 levels deep (protobuf's limit), got a "
            "deeper one; a google.protobuf.Struct such as spec.env_config or spec.hyperparameters nests too "
            "deep: task options may nest lists and mappings at most 3 levels"
        )
        assert "DecodeError" not in err.details()
        # Without a key the call is refused as any other (the key is checked first).
        with pytest.raises(grpc.RpcError) as info:
            submit(request, timeout=30)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Garbage bytes: INVALID_ARGUMENT too.
        with pytest.raises(grpc.RpcError) as info:
            submit(b"\xff\xff\xff", metadata=metadata(sched.user_key), timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == (
            "request: expected a valid protobuf SubmitTask request, got bytes that do not parse as one"
        )
    # The scheduler keeps answering.
    with RLClient(sched.target, api_key=sched.user_key) as alice:
        alice.list_tasks()


def test_list_nodes_is_for_admin_keys(sched) -> None:
    with RLClient(sched.target, api_key=sched.user_key) as alice:
        with pytest.raises(PermissionDeniedError) as info:
            alice.list_nodes()
    assert "may not call /opentinker.scheduler.v1.SchedulerService/ListNodes: it lists every trainer node" in str(
        info.value
    )
    with RLClient(sched.target, api_key=sched.admin_key) as root:
        assert root.list_nodes() == []


def test_control_characters_in_a_cancel_reason_or_key_description_are_refused(sched) -> None:
    from opentinker.scheduler.v1 import admin_pb2, admin_pb2_grpc

    with RLClient(sched.target, api_key=sched.user_key) as alice:
        task_id = alice.submit_task(workload_type="lora_finetune", model="org/m")
    with grpc.insecure_channel(sched.target) as ch:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            stub.CancelTask(
                S.CancelTaskRequest(task_id=task_id, reason="done\x1b]0;PWNED\x07"),
                metadata=metadata(sched.user_key),
                timeout=30,
            )
        err = info.value
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.details() == (
            "reason: expected text on one line without control characters, got U+001B (ESC) at character 4"
        )
        (detail,) = rpc_status.from_call(err).details
        bad = error_details_pb2.BadRequest()
        assert detail.Unpack(bad) and bad.field_violations[0].field == "reason"
        task = stub.GetTask(S.GetTaskRequest(task_id=task_id), metadata=metadata(sched.user_key), timeout=30).task
        assert task.state == common_pb2.TASK_STATE_PENDING  # nothing changed
        stub.CancelTask(S.CancelTaskRequest(task_id=task_id, reason="done"), metadata=metadata(sched.user_key))

        admin = admin_pb2_grpc.AdminServiceStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            admin.CreateApiKey(
                admin_pb2.CreateApiKeyRequest(
                    owner="bob", role=admin_pb2.API_KEY_ROLE_USER, description="ci\nbob-admin  ADMIN  active"
                ),
                metadata=metadata(sched.admin_key),
                timeout=30,
            )
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == (
            "description: expected text on one line without control characters, got U+000A (newline) at character 2"
        )
    with RLClient(sched.target, api_key=sched.admin_key) as root:
        assert [k for k in root.keys.list() if k.owner == "bob"] == []  # no key was made


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("node_id", "rack\x1b]0;PWNED\x07", "U+001B (ESC) at character 4"),
        ("hostname", "host\nnode-b  connected", "U+000A (newline) at character 4"),
        ("version", "1.0\u202e", "U+202E (RIGHT-TO-LEFT OVERRIDE) at character 3"),
        ("gpu_note", "NVML \x9b31m", "U+009B (a control character) at character 5"),
    ],
)
def test_control_characters_in_a_node_registration_are_refused(sched, field, value, message) -> None:
    """A node key's Register is text that reaches logs, pending reasons and every terminal that
    lists nodes: the scheduler refuses control characters in it, naming the field."""
    from opentinker.node.v1 import node_pb2, node_pb2_grpc

    with RLClient(sched.target, api_key=sched.admin_key) as root:
        _, node_key = root.keys.create(f"rack-{field}", "node")
    register = node_pb2.Register(node_id=f"node-{field}", max_tasks=1)
    setattr(register, field, value)
    with grpc.insecure_channel(sched.target) as ch:
        call = node_pb2_grpc.NodeServiceStub(ch).Connect(
            iter([node_pb2.ConnectRequest(register=register)]), metadata=metadata(node_key), timeout=30
        )
        with pytest.raises(grpc.RpcError) as info:
            next(call)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == (
        f"register.{field}: expected text on one line without control characters, got {message}"
    )
    assert f"node-{field}" not in sched.do(lambda: set(sched.core.ledger.nodes))  # nothing registered
