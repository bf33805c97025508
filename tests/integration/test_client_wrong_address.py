"""A client pointed at the wrong address gets one line naming the address, decoded, and the likely
mistake: nothing listening there, or the scheduler's HTTP port (naming its gRPC port)."""

from __future__ import annotations

import pytest

from opentinker_client import RLClient
from opentinker_client._reach import _tried
from opentinker_client.errors import UnavailableError
from tests.support.http import http_get
from tests.support.procs import free_port


def error_of(url: str) -> UnavailableError:
    with RLClient(scheduler_url=url) as client, pytest.raises(UnavailableError) as err:
        client.list_tasks()
    assert "\n" not in str(err.value) and "%5B" not in str(err.value)
    return err.value


def test_nothing_listening_says_so_and_names_the_address() -> None:
    port = free_port()
    err = error_of(f"127.0.0.1:{port}")
    assert str(err) == (
        f"UNAVAILABLE: cannot reach the scheduler at 127.0.0.1:{port}: nothing is listening on 127.0.0.1:{port} "
        f"(connection refused); is the scheduler running, and is {port} its gRPC port (its --port, 8888 by default)?"
    )
    assert "failed to connect to all addresses" in err.raw_details


def test_the_http_port_is_named_with_the_grpc_port_to_use(cluster) -> None:
    cluster.start_scheduler()
    status, _ = http_get(f"http://127.0.0.1:{cluster.http_port}/health")
    assert status == 200
    err = error_of(f"http://127.0.0.1:{cluster.http_port}")
    assert str(err) == (
        f"UNAVAILABLE: cannot talk gRPC to 127.0.0.1:{cluster.http_port}: that is the scheduler's HTTP port "
        f"(/health, /metrics); its gRPC port is {cluster.port}: use 127.0.0.1:{cluster.port}"
    )
    with RLClient(scheduler_url=f"127.0.0.1:{cluster.port}") as client:  # the advice works
        assert client.list_tasks() == []


def test_an_http_port_that_is_not_the_schedulers_is_called_an_http_port(cluster) -> None:
    cluster.start_scheduler()
    trainer_http = free_port()
    trainer = cluster.start_trainer("node-a", "--http-port", str(trainer_http))
    cluster.wait_nodes(1)
    err = error_of(f"127.0.0.1:{trainer_http}")
    assert str(err).startswith(f"UNAVAILABLE: cannot talk gRPC to 127.0.0.1:{trainer_http}: that is an HTTP/1.1 port")
    assert "the scheduler's gRPC port (its --port)" in str(err)
    trainer.terminate()


def test_a_host_that_does_not_resolve_is_named() -> None:
    err = error_of("no-such-host.invalid:8888")
    assert "the host name 'no-such-host.invalid' does not resolve" in str(err)


def test_the_address_gRPC_tried_is_decoded() -> None:
    assert _tried("last error: UNKNOWN: ipv6:%5B::1%5D:22999: Failed to connect") == "[::1]:22999"
    assert _tried("ipv4:127.0.0.1:1: Failed") == "127.0.0.1:1"
