"""EnvironmentService hosting an Environment that lives in this test process, over real gRPC."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from opentinker.environment.v1 import environment_pb2 as pb
from opentinker.environment.v1 import environment_pb2_grpc as pb_grpc
from opentinker_client import Environment, InvalidArgumentError
from opentinker_client.hosting.server import EnvironmentServer

from tests.support.environments import Corridor


class Raising(Corridor):
    def step(self, action):
        raise RuntimeError("the physics engine exploded at t=3")


class Slow(Corridor):
    def step(self, action):
        time.sleep(1.0)
        return super().step(action)


class BadObservation(Corridor):
    def step(self, action):
        return 99, 0.0, False, False, {}


class _Bearer(grpc.UnaryUnaryClientInterceptor):
    """Adds ``authorization: Bearer <token>`` to every call, as the trainer does."""

    def __init__(self, token: str) -> None:
        self.token = token

    def intercept_unary_unary(self, continuation, details, request):
        metadata = list(details.metadata or ()) + [("authorization", f"Bearer {self.token}")]
        return continuation(details._replace(metadata=metadata), request)


@pytest.fixture
def serve():
    servers = []

    def start(env, **kw):
        server = EnvironmentServer(env, **kw).start()
        servers.append(server)
        channel = grpc.intercept_channel(grpc.insecure_channel(server.endpoint), _Bearer(server.token))
        return server, pb_grpc.EnvironmentServiceStub(channel)

    yield start
    for s in servers:
        s.stop(grace=0)


def reset(stub, session="s", *indexes, seed=None):
    items = [pb.ResetItem(env_index=i, **({} if seed is None else {"seed": seed})) for i in indexes or (0,)]
    return stub.Reset(pb.ResetRequest(session_id=session, items=items), timeout=5)


def step(stub, session="s", **actions):
    items = [pb.StepItem(env_index=int(i[1:]), action=pb.Action(discrete=a)) for i, a in actions.items()]
    return stub.Step(pb.StepRequest(session_id=session, items=items), timeout=5)


def test_reset_step_round_trip_with_batched_instances(serve):
    env = Corridor()
    server, stub = serve(env)
    assert server.env_config == {
        "env_id": "client",
        "endpoint": server.endpoint,
        "action_space": 2,
        "observation_space": 5,
        "observation_type": "discrete",
        "action_names": ["left", "right"],
        "timeout_s": 30.0,
        "grace_s": 30.0,
        "token": server.token,
    }
    assert len(server.token) == 43  # secrets.token_urlsafe(32)
    d = stub.Describe(pb.DescribeRequest(), timeout=5)
    assert (
        d.action_space.discrete.n == 2
        and d.observation_space.discrete.n == 5
        and list(d.action_names) == ["left", "right"]
    )
    assert d.name == "Corridor"

    res = reset(stub, "s", 0, 1, seed=7)
    assert [(r.env_index, r.observation.discrete) for r in res.results] == [(0, 0), (1, 0)]
    # Batched step: two independent instances (copies of env), in request order.
    res = step(stub, e0=1, e1=0)
    assert [(r.env_index, r.observation.discrete, r.reward, r.terminated) for r in res.results] == [
        (0, 1, 0.0, False),
        (1, 0, 0.0, False),
    ]
    assert res.results[0].info["pos"] == 1
    for _ in range(3):
        res = step(stub, e0=1)
    assert (res.results[0].observation.discrete, res.results[0].reward, res.results[0].terminated) == (4, 1.0, True)
    assert env.pos == 0 and env.seeds == []  # the served object itself is only the template

    # The finished episode refuses more steps until it is reset.
    with pytest.raises(grpc.RpcError) as err:
        step(stub, e0=1)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "Reset" in err.value.details()
    assert reset(stub, "s", 0).results[0].observation.discrete == 0
    stub.Close(pb.CloseRequest(session_id="s"), timeout=5)
    stub.Close(pb.CloseRequest(session_id="s"), timeout=5)  # idempotent
    assert server.servicer.session_count() == 0


def test_bad_requests_get_the_right_status(serve):
    _, stub = serve(Corridor())
    with pytest.raises(grpc.RpcError) as err:
        step(stub, "never-reset", e0=1)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    reset(stub)
    with pytest.raises(grpc.RpcError) as err:
        step(stub, e0=2)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "Discrete(2)" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.Reset(pb.ResetRequest(session_id="", items=[pb.ResetItem()]), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "session_id" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.Reset(
            pb.ResetRequest(session_id="s", items=[pb.ResetItem(env_index=1), pb.ResetItem(env_index=1)]), timeout=5
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "once" in err.value.details()


def test_environment_that_raises_returns_its_message(serve):
    _, stub = serve(Raising())
    reset(stub)
    with pytest.raises(grpc.RpcError) as err:
        step(stub, e0=1)
    assert err.value.code() == grpc.StatusCode.UNKNOWN
    assert err.value.details() == "Raising.step raised RuntimeError: the physics engine exploded at t=3"


def test_observation_outside_the_declared_space_is_refused(serve):
    _, stub = serve(BadObservation())
    reset(stub)
    with pytest.raises(grpc.RpcError) as err:
        step(stub, e0=1)
    assert (
        err.value.code() == grpc.StatusCode.INTERNAL
        and "99" in err.value.details()
        and "Discrete(5)" in err.value.details()
    )


def test_slow_environment_hits_the_callers_deadline(serve):
    _, stub = serve(Slow())
    reset(stub)
    with pytest.raises(grpc.RpcError) as err:
        stub.Step(
            pb.StepRequest(session_id="s", items=[pb.StepItem(env_index=0, action=pb.Action(discrete=1))]), timeout=0.2
        )
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_box_observations_and_a_factory(serve):
    class Sensors(Environment):
        def __init__(self):
            super().__init__(action_space=3, observation_space=4, observation_type="box")

        def reset(self, seed=None):
            return [[0.0, 1.0], [2.0, 3.5]], {"note": "2x2 flattened"}

        def step(self, action):
            return [float(action)] * 4, -1.0, False, True, {}

    made = []

    def factory():
        made.append(1)
        return Sensors()

    server, stub = serve(Sensors(), factory=factory)
    assert server.env_config["observation_type"] == "box"
    r = reset(stub, "s", 0, 1).results[0]
    assert list(r.observation.box.values) == [0.0, 1.0, 2.0, 3.5] and r.info["note"] == "2x2 flattened"
    s = step(stub, e1=2).results[0]
    assert list(s.observation.box.values) == [2.0] * 4 and s.truncated and not s.terminated
    assert len(made) == 2


def test_health_and_reflection_are_served(serve):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    server, _ = serve(Corridor())
    channel = grpc.insecure_channel(server.endpoint)
    health = health_pb2_grpc.HealthStub(channel)
    status = health.Check(
        health_pb2.HealthCheckRequest(service="opentinker.environment.v1.EnvironmentService"), timeout=5
    )
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
    names = {s.name for r in responses for s in r.list_services_response.service}
    assert "opentinker.environment.v1.EnvironmentService" in names


def test_undeclared_spaces_are_refused_before_binding():
    class Undeclared(Environment):
        def step(self, action):
            return 0, 0.0, True, False, {}

    with pytest.raises(InvalidArgumentError) as err:
        EnvironmentServer(Undeclared())
    assert err.value.field == "spec.env_config.action_space"


def test_calls_in_one_session_run_one_at_a_time(serve):
    inside = []
    overlaps = []

    class Tracked(Corridor):
        def step(self, action):
            if inside:
                overlaps.append(1)
            inside.append(1)
            time.sleep(0.02)
            inside.pop()
            return super().step(action)

    _, stub = serve(Tracked(length=100))
    reset(stub, "s", 0, 1)
    threads = [threading.Thread(target=lambda i=i: [step(stub, **{f"e{i}": 1}) for _ in range(5)]) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not overlaps
