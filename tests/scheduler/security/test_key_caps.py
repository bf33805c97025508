"""Bounds on API keys: a key is rotated at most once, and an owner holds
at most ``limits.max_keys_per_owner`` active keys. Through a real scheduler on loopback, plus
KeyStore units against a real SQLite store."""

from __future__ import annotations

import grpc
import pytest

from opentinker.scheduler.v1 import admin_pb2 as A, admin_pb2_grpc
from opentinker_client import FailedPreconditionError, RLClient
from opentinker_client.errors import ResourceExhaustedError
from opentinker_scheduler.config import ConfigError, parse_config
from opentinker_scheduler.errors import FailedPrecondition, ResourceExhausted
from opentinker_scheduler.security.keys import KeyStore
from tests.support.stores import make_store

from tests.support.security import LoopbackScheduler, metadata

AUTH = "auth: {enabled: true}\nlimits: {max_keys_per_owner: 3}\n"


@pytest.fixture
def sched(tmp_path):
    with LoopbackScheduler(tmp_path / "state", AUTH) as s:
        yield s


@pytest.fixture
def keys(tmp_path, store_backend):
    store = make_store(tmp_path / "s")
    yield KeyStore(store, max_keys_per_owner=3)
    store.close()


def _active(s: LoopbackScheduler, owner: str) -> int:
    return s.do(lambda: s.security.keys.active_count(owner))


def test_a_key_with_a_grace_period_successor_cannot_be_rotated_again(sched) -> None:
    with RLClient(sched.target, api_key=sched.admin_key) as root:
        info, key = root.keys.create("alice", "user")
    with RLClient(sched.target, api_key=key) as alice:
        new, new_key, old = alice.keys.rotate(info.prefix, grace=30 * 86400)
        assert old.active and old.replaced_by == new.prefix
        with pytest.raises(
            FailedPreconditionError,
            match=rf"API key {info.prefix} was already rotated to {new.prefix}; rotate that one",
        ):
            alice.keys.rotate(info.prefix, grace=30 * 86400)
        with pytest.raises(FailedPreconditionError, match="already rotated"):  # grace 0 too
            alice.keys.rotate(info.prefix)
    assert _active(sched, "alice") == 2  # the refused rotations made no key
    with RLClient(sched.target, api_key=new_key) as alice:
        newer, _, _ = alice.keys.rotate(new.prefix, grace=60)  # the successor may be rotated
        assert newer.prefix not in (info.prefix, new.prefix)


def test_chained_rotations_with_grace_stop_at_max_keys_per_owner(sched) -> None:
    with RLClient(sched.target, api_key=sched.admin_key) as root:
        info, key = root.keys.create("alice", "user")
    prefix = info.prefix
    with RLClient(sched.target, api_key=key) as alice:
        for _ in range(2):  # 1 -> 2 -> 3 active keys
            prefix = alice.keys.rotate(prefix, grace=30 * 86400)[0].prefix
        assert _active(sched, "alice") == 3
        with pytest.raises(
            ResourceExhaustedError,
            match=r"owner 'alice' already has 3 active API key\(s\), the limit is 3 \(limits.max_keys_per_owner\)",
        ) as err:
            alice.keys.rotate(prefix, grace=30 * 86400)
        assert "rotate with grace 0" in str(err.value)
        assert _active(sched, "alice") == 3 and len(alice.keys.list(include_inactive=True)) == 3  # nothing half-written
        new, _, old = alice.keys.rotate(prefix)  # without grace the count stays the same: allowed
        assert not old.active and _active(sched, "alice") == 3


def test_admins_creating_keys_for_an_owner_are_capped_and_audited(sched) -> None:
    admin = sched.admin_key
    with sched.channel() as ch:
        stub = admin_pb2_grpc.AdminServiceStub(ch)
        md = metadata(admin)
        made = [
            stub.CreateApiKey(A.CreateApiKeyRequest(owner="bob", role=A.API_KEY_ROLE_USER), metadata=md)
            for _ in range(3)
        ]
        with pytest.raises(grpc.RpcError) as err:
            stub.CreateApiKey(A.CreateApiKeyRequest(owner="bob", role=A.API_KEY_ROLE_NODE), metadata=md)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "limits.max_keys_per_owner" in err.value.details() and "'bob'" in err.value.details()
        # other owners are not affected; revoking one of bob's frees a slot
        stub.CreateApiKey(A.CreateApiKeyRequest(owner="carol", role=A.API_KEY_ROLE_USER), metadata=md)
        stub.RevokeApiKey(A.RevokeApiKeyRequest(prefix=made[0].key.prefix), metadata=md)
        stub.CreateApiKey(A.CreateApiKeyRequest(owner="bob", role=A.API_KEY_ROLE_USER), metadata=md)
        events = stub.ListAuditEvents(A.ListAuditEventsRequest(action="key.create"), metadata=md).events
        assert [e.outcome for e in events].count("RESOURCE_EXHAUSTED") == 1


def test_keys_expired_after_their_grace_period_no_longer_count(keys) -> None:
    row, _ = keys.create("alice", "user")
    keys.rotate(row.prefix, grace_s=60)
    keys.create("alice", "user")
    with pytest.raises(ResourceExhausted, match="max_keys_per_owner"):
        keys.create("alice", "user")
    real = keys.clock
    keys.clock = lambda: real() + 61
    assert keys.active_count("alice") == 2
    keys.create("alice", "user")
    with pytest.raises(FailedPrecondition, match="already revoked or expired"):  # the expired key itself
        keys.rotate(row.prefix)


def test_zero_means_no_limit_and_the_config_key_is_range_checked(tmp_path, store_backend) -> None:
    store = make_store(tmp_path / "s")
    try:
        keys = KeyStore(store, max_keys_per_owner=0)
        for _ in range(25):
            keys.create("alice", "user")
        assert keys.active_count("alice") == 25
    finally:
        store.close()
    assert parse_config("limits: {max_keys_per_owner: 5}\n", "c.yaml").limits.max_keys_per_owner == 5
    assert parse_config("", "c.yaml").limits.resolved(auth_enabled=True).max_keys_per_owner == 20
    for bad in ("-1", "many", "1.5"):
        with pytest.raises(ConfigError, match=r"c\.yaml:1:30: limits\.max_keys_per_owner"):
            parse_config(f"limits: {{max_keys_per_owner: {bad}}}\n", "c.yaml")


def test_default_cap_is_20(tmp_path) -> None:
    s = LoopbackScheduler(tmp_path / "state", "auth: {enabled: true}\n")
    try:
        with RLClient(s.target, api_key=s.admin_key) as root:
            for _ in range(20):
                root.keys.create("dave", "user")
            with pytest.raises(ResourceExhaustedError, match="the limit is 20"):
                root.keys.create("dave", "user")
    finally:
        s.close()


def test_a_user_key_may_not_rotate_or_revoke_its_owners_admin_or_node_keys(sched) -> None:
    """Otherwise a user key could rotate its owner's admin key and receive the new admin key."""
    from opentinker_client import PermissionDeniedError

    with RLClient(sched.target, api_key=sched.admin_key) as root:
        admin_info, _ = root.keys.create("dave", "admin")
        node_info, _ = root.keys.create("dave", "node")
        user_info, user_key = root.keys.create("dave", "user")
    with RLClient(sched.target, api_key=user_key) as dave:
        for target in (admin_info.prefix, node_info.prefix):
            with pytest.raises(PermissionDeniedError, match=rf"\(role user\) may not rotate {target}, a key of role"):
                dave.keys.rotate(target)
            with pytest.raises(PermissionDeniedError, match=rf"may not revoke {target}"):
                dave.keys.revoke(target)
        assert {k.prefix for k in dave.keys.list()} >= {admin_info.prefix, node_info.prefix}  # untouched, still active
        new, _, _ = dave.keys.rotate(user_info.prefix)  # its own role: fine
        assert new.role == "user"
    assert _active(sched, "dave") == 3


def test_a_revoked_successor_lets_the_old_key_rotate_again_within_its_grace(sched) -> None:
    with RLClient(sched.target, api_key=sched.admin_key) as root:
        info, key = root.keys.create("erin", "user")
    with RLClient(sched.target, api_key=key) as erin:
        first, _, _ = erin.keys.rotate(info.prefix, grace=600)
        erin.keys.revoke(first.prefix)
        second, second_key, _ = erin.keys.rotate(info.prefix, grace=0)  # not stranded
        assert second.prefix not in (info.prefix, first.prefix)
    with RLClient(sched.target, api_key=second_key) as erin:
        assert erin.list_tasks() == []


def test_an_expired_key_does_not_point_to_a_revoked_successor(keys) -> None:
    now = [1000.0]
    keys.clock = lambda: now[0]
    info, key = keys.create("fay", "user")
    new, _, _ = keys.rotate(info.prefix, grace_s=10)
    keys.revoke(new.prefix)
    now[0] += 11
    assert keys.refusal(info.prefix) == (
        f"API key {info.prefix} expired after rotation, and its successor {new.prefix} "
        "is revoked or expired too; ask an admin for a new key"
    )
