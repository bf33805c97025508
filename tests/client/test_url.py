import pytest

from opentinker_client.url import parse_scheduler_url


@pytest.mark.parametrize(
    "url, target",
    [
        ("http://scheduler-host:8888", "scheduler-host:8888"),
        ("http://scheduler-host:8888/", "scheduler-host:8888"),
        ("HTTP://Scheduler-Host:8888", "scheduler-host:8888"),
        ("scheduler-host:8888", "scheduler-host:8888"),
        ("  localhost:1  ", "localhost:1"),
        ("grpc://10.0.0.5:65535", "10.0.0.5:65535"),
        ("[::1]:8888", "[::1]:8888"),
        ("http://[::1]:8888", "[::1]:8888"),
        ("grpc://[2001:DB8::1]:9000", "[2001:db8::1]:9000"),
        ("gpu_node.cluster.local:50051", "gpu_node.cluster.local:50051"),
    ],
)
def test_accepted(url, target):
    assert parse_scheduler_url(url) == target


@pytest.mark.parametrize(
    "url, words",
    [
        ("", "empty"),
        ("   ", "empty"),
        ("scheduler-host", "port is missing"),
        ("http://scheduler-host", "port is missing"),
        ("scheduler-host:", "port is missing"),
        ("scheduler-host:http", "not a number"),
        ("scheduler-host:0", "out of range"),
        ("scheduler-host:65536", "out of range"),
        ("scheduler-host:-1", "not a number"),
        ("http://scheduler-host:8888/api", "path"),
        ("http://scheduler-host:8888?x=1", "query"),
        ("http://user@scheduler-host:8888", "user"),
        ("https://scheduler-host:8888", "TLS"),
        ("grpcs://scheduler-host:8888", "TLS"),
        ("ftp://scheduler-host:8888", "unknown scheme"),
        ("::1:8888", "brackets"),
        ("[::1]", "port is missing"),
        ("[::1:8888", "unclosed"),
        ("[not-ipv6]:8888", "not an IPv6"),
        (":8888", "host is missing"),
        ("http://", "host is missing"),
        ("bad host:8888", "not a valid host"),
        ("-bad:8888", "not a valid host"),
    ],
)
def test_refused(url, words):
    with pytest.raises(ValueError) as exc:
        parse_scheduler_url(url)
    assert words in str(exc.value)
    assert "e.g." in str(exc.value) or "TLS" in str(exc.value)


def test_not_a_string():
    with pytest.raises(TypeError):
        parse_scheduler_url(8888)  # type: ignore[arg-type]
