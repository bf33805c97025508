import pytest

from opentinker_common.net.url import SchedulerAddress, parse_scheduler_address, parse_scheduler_url


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
        ("https://scheduler-host:8888", "scheduler-host:8888"),
        ("grpcs://[::1]:443/", "[::1]:443"),
    ],
)
def test_accepted(url, target):
    assert parse_scheduler_url(url) == target


@pytest.mark.parametrize(
    "url, address",
    [
        ("https://Scheduler-Host:8888", SchedulerAddress("scheduler-host:8888", tls=True, scheme="https")),
        ("HTTPS://scheduler-host:8888/", SchedulerAddress("scheduler-host:8888", tls=True, scheme="https")),
        ("grpcs://10.0.0.5:443", SchedulerAddress("10.0.0.5:443", tls=True, scheme="grpcs")),
        ("grpcs://[2001:db8::1]:9000", SchedulerAddress("[2001:db8::1]:9000", tls=True, scheme="grpcs")),
        # TLS for these only when a CA is given (root_certificates, --tls-ca, $OPENTINKER_TLS_CA):
        ("http://scheduler-host:8888", SchedulerAddress("scheduler-host:8888", tls=False, scheme="http")),
        ("grpc://scheduler-host:8888", SchedulerAddress("scheduler-host:8888", tls=False, scheme="grpc")),
        ("scheduler-host:8888", SchedulerAddress("scheduler-host:8888", tls=False, scheme="")),
    ],
)
def test_address_says_whether_the_url_asks_for_tls(url, address):
    assert parse_scheduler_address(url) == address


@pytest.mark.parametrize(
    "url", ["https://scheduler-host", "https://h:0", "grpcs://h:1/path", "https://user@h:1", "httpss://h:1"]
)
def test_tls_urls_are_checked_like_the_others(url):
    with pytest.raises(ValueError, match="e.g."):
        parse_scheduler_address(url)


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
        ("ftp://scheduler-host:8888", "unknown scheme"),
        ("https://scheduler-host", "port is missing"),
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
    assert "e.g." in str(exc.value)


def test_not_a_string():
    with pytest.raises(TypeError):
        parse_scheduler_url(8888)  # type: ignore[arg-type]


# ------------------------------------------------------------------ a password is never echoed


@pytest.mark.parametrize(
    "url, shown",
    [
        ("https://alice:hunter2@host:1", "https://***@host:1"),
        ("alice:hunter2@host:1", "***@host:1"),
        ("grpcs://alice:hun/ter?2#x@host:1", "grpcs://***@host:1"),  # a password with / ? #: still "a user name"
        ("http://alice:hun@ter2@host:1/path", "http://***@host:1/path"),
        ("alice:hun://ter2@host:1", "***@host:1"),  # not a scheme: all of it is user info
        ("ftp://alice:hunter2@host:1", "ftp://***@host:1"),  # refused for the user name, not the scheme
    ],
)
def test_the_user_info_of_a_refused_url_is_never_echoed(url, shown):
    with pytest.raises(ValueError) as exc:
        parse_scheduler_address(url)
    message = str(exc.value)
    assert message.startswith(f"bad scheduler URL {shown!r}: it has a user name ('@')"), message
    for secret in ("alice", "hunter2", "hun", "ter2"):
        assert secret not in message


def test_redact_userinfo_leaves_urls_without_one_alone():
    from opentinker_common.net.url import redact_userinfo

    assert redact_userinfo("https://host:1") == "https://host:1"
    assert redact_userinfo("[::1]:8888") == "[::1]:8888"
    assert redact_userinfo("https://user:pw@host:1") == "https://***@host:1"
