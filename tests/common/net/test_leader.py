"""Several scheduler URLs and following the leader a follower names."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2

from opentinker_common.net.leader import SchedulerTargets, not_leader, parse_scheduler_urls


def test_one_or_several_urls() -> None:
    assert [a.target for a in parse_scheduler_urls("http://Host-A:8888")] == ["host-a:8888"]
    got = parse_scheduler_urls("host-a:8888, http://host-b:8888,host-a:8888")
    assert [a.target for a in got] == ["host-a:8888", "host-b:8888"]
    with pytest.raises(ValueError, match="an empty entry"):
        parse_scheduler_urls("host-a:8888,,host-b:1")
    with pytest.raises(ValueError, match="the port is missing"):
        parse_scheduler_urls("host-a:8888,host-b")
    with pytest.raises(ValueError, match="some entries ask for TLS"):
        parse_scheduler_urls("https://a:1,b:2")


class _Err(grpc.RpcError):
    def __init__(self, metadata=()) -> None:
        self._metadata = metadata

    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def trailing_metadata(self):
        return self._metadata


def _refusal(leader: str, reason: str = "NOT_LEADER") -> _Err:
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.ErrorInfo(reason=reason, domain="opentinker.scheduler", metadata={"leader": leader}))
    status = status_pb2.Status(code=14, message="follower", details=[detail])
    return _Err((("grpc-status-details-bin", status.SerializeToString()),))


def test_not_leader_reads_the_error_info() -> None:
    assert not_leader(_refusal("host-b:8888")) == "host-b:8888"
    assert not_leader(_refusal("")) == ""
    assert not_leader(_refusal("x", reason="OTHER")) is None
    assert not_leader(_Err()) is None


def test_targets_follow_the_leader_and_move_on_from_unreachable_ones() -> None:
    t = SchedulerTargets(["a:1", "b:1", "c:1"])
    assert t.current == "a:1"
    assert t.moved(_refusal("c:1")) and t.current == "c:1"
    assert t.moved(_Err()) and t.current == "a:1"  # unreachable: the next one
    assert t.moved(_refusal("elsewhere:9")) and t.current == "elsewhere:9"  # a leader nobody listed
    assert t.moved(_Err()) and t.current == "a:1"  # ... dropped once it cannot be reached
    assert t.moved(_refusal("")) and t.current == "b:1"  # an election: try another
    # Right after a leader died, followers still name it: a named leader that just failed is not
    # followed again for a moment; the caller keeps asking the follower.
    t2 = SchedulerTargets(["a:1", "b:1"])
    assert t2.moved(_Err()) and t2.current == "b:1"  # a:1 died
    assert t2.moved(_refusal("a:1")) and t2.current == "b:1", "followed a leader that just failed"
    one = SchedulerTargets(["lb:1"])
    assert not one.moved(_Err()), "one address that cannot be reached: nowhere else to go"
    assert one.moved(_refusal("")) and one.current == "lb:1"  # a follower behind it: try again


class _FakeChannel:
    """A channel whose unary calls fail with ``err`` (None: answer its name)."""

    def __init__(self, name: str, err=None) -> None:
        self.name, self.err, self.calls, self.closed = name, err, 0, False

    def unary_unary(self, method, *args, **kwargs):
        def call(request, timeout=None, metadata=None):
            self.calls += 1
            if self.err is not None:
                raise self.err
            return f"{self.name}:{method}:{request}"

        return call

    def close(self) -> None:
        self.closed = True


def test_following_channel_retries_a_unary_call_on_the_leader() -> None:
    from opentinker_common.net.leader import FollowingChannel

    fakes = {"a:1": _FakeChannel("a", _refusal("b:1")), "b:1": _FakeChannel("b")}
    channel = FollowingChannel(["a:1", "b:1"], fakes.__getitem__)
    assert channel.unary_unary("/S/M")("req", timeout=5) == "b:/S/M:req"
    assert fakes["a:1"].calls == 1 and channel.targets.current == "b:1"
    assert channel.unary_unary("/S/M")("again") == "b:/S/M:again" and fakes["a:1"].calls == 1
    channel.close()
    assert all(f.closed for f in fakes.values())


def test_during_an_election_the_live_follower_is_asked_again_not_the_address_that_just_failed() -> None:
    t = SchedulerTargets(["a:1", "b:1", "c:1"])
    assert t.moved(_Err()) and t.current == "b:1"  # the leader a died: its address refuses
    assert t.moved(_refusal("a:1")) and t.current == "b:1", "b still names the dead leader: not followed"
    assert t.moved(_refusal("")) and t.current == "c:1", "b knows no leader: ask c, which has not failed"
    assert t.moved(_refusal("")) and t.current == "b:1", "c neither: back to b, not to a"
    two = SchedulerTargets(["a:1", "b:1"])
    assert two.moved(_Err()) and two.current == "b:1"
    assert two.moved(_refusal("")) and two.current == "b:1", "b lives and may lead next; a just failed"
    assert two.moved(_refusal("b:1")) and two.current == "b:1"
