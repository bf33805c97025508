"""RewardServer: a user's reward function served over EnvironmentService.Score (real gRPC on
loopback): the token, what each kind of return value becomes, and the status codes."""

from __future__ import annotations

import grpc
import pytest

from opentinker.environment.v1 import environment_pb2 as pb
from opentinker.environment.v1 import environment_pb2_grpc as pb_grpc
from opentinker_client.errors import InvalidArgumentError
from opentinker_client.hosting.reward import RewardServer
from opentinker_common.spec import validate_env_config


def request(*completions: str) -> pb.ScoreRequest:
    items = [pb.ScoreItem(prompt=f"q{i}", completion=c) for i, c in enumerate(completions)]
    for item in items:
        item.metadata.update({"answer": 4, "tags": ["a"]})
    return pb.ScoreRequest(items=items)


@pytest.fixture
def serve():
    servers = []

    def start(fn, **kw):
        server = RewardServer(fn, **kw).start()
        servers.append(server)
        channel = grpc.insecure_channel(server.endpoint)
        meta = (("authorization", f"Bearer {server.token}"),) if server.token else ()
        return server, pb_grpc.EnvironmentServiceStub(channel), meta

    yield start
    for s in servers:
        s.stop(grace=0)


def test_rewards_come_back_in_order_and_bad_values_say_why(serve) -> None:
    seen = {}

    def fn(prompts, completions, metadata):
        seen.update(prompts=prompts, metadata=metadata)
        return [1.0, float("nan"), "0.5", None, True, 3, float("inf")]

    _, stub, meta = serve(fn)
    res = stub.Score(request(*"abcdefg"), metadata=meta, timeout=10).results
    assert seen["prompts"] == [f"q{i}" for i in range(7)] and seen["metadata"][0] == {"answer": 4, "tags": ["a"]}
    assert [r.reward if r.HasField("reward") else None for r in res] == [1.0, None, None, None, None, 3.0, None]
    assert "returned nan" in res[1].error and "returned str '0.5', not a number" in res[2].error
    assert "NoneType" in res[3].error and "bool True" in res[4].error and "inf" in res[6].error


def test_a_function_that_raises_or_returns_the_wrong_shape(serve) -> None:
    def boom(prompts, completions, metadata):
        raise ValueError("judge offline")

    _, stub, meta = serve(boom)
    with pytest.raises(grpc.RpcError) as err:
        stub.Score(request("a"), metadata=meta, timeout=10)
    assert err.value.code() == grpc.StatusCode.UNKNOWN
    assert "raised ValueError: judge offline" in err.value.details()

    _, stub, meta = serve(lambda p, c, m: [1.0])
    with pytest.raises(grpc.RpcError) as err:
        stub.Score(request("a", "b"), metadata=meta, timeout=10)
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert "returned 1 values for 2 items" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.Score(pb.ScoreRequest(), metadata=meta, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_the_token_is_required_and_the_environment_calls_are_unimplemented(serve) -> None:
    calls = []
    server, stub, meta = serve(lambda p, c, m: calls.append(1) or [0.0] * len(c))
    for bad in ((), (("authorization", "Bearer " + "x" * 43),)):
        with pytest.raises(grpc.RpcError) as err:
            stub.Score(request("a"), metadata=bad, timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert not calls  # refused before the function ran
    with pytest.raises(grpc.RpcError) as err:
        stub.Reset(pb.ResetRequest(session_id="s"), metadata=meta, timeout=10)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert server.token not in repr(server)


def test_reward_config_is_what_the_scheduler_accepts() -> None:
    server = RewardServer(lambda p, c, m: [0.0] * len(c), timeout_s=5, max_consecutive_failures=4)
    try:
        cfg = server.reward_config
        assert cfg["verifier"] == "client" and cfg["endpoint"] == server.endpoint and cfg["token"] == server.token
        env = validate_env_config({"env_id": "prompts", "path": "/d.jsonl", "reward": cfg})
        assert (env.reward.timeout_s, env.reward.max_consecutive_failures) == (5.0, 4)
    finally:
        server.stop(grace=0)
    with pytest.raises(InvalidArgumentError, match="callable"):
        RewardServer("not a function")
    with pytest.raises(InvalidArgumentError) as err:
        RewardServer(lambda p, c, m: [], timeout_s=0)
    assert err.value.field == "spec.env_config.reward.timeout_s"
