"""The OpenAI-compatible endpoint bounds what it reads, against a real uvicorn server on
loopback: a body over the limit is refused with 413 from its Content-Length before any of it is
read, and while it streams when chunked; a seed past 64 bits, NaN, a body nested 10,000 levels
deep, bad JSON or a wrong type is a 400 in OpenAI's error shape, never a plain-text 500; and
the server keeps answering after each."""

from __future__ import annotations

import http.client
import json
import select
import socket
from pathlib import Path

import pytest

from tests.support.inference import ServerThread, tiny_runtime

#: A hang guard on each socket read: every answer here comes at once.
READ_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path):
    from opentinker_trainer.inference.openai_http import start_openai_server

    grpc_server = ServerThread(tiny_runtime(tiny_model_dir))
    http_server = grpc_server.call(start_openai_server(grpc_server.runtime, host="127.0.0.1", port=0))
    yield http_server.port, str(tiny_model_dir)
    grpc_server.call(http_server.stop())
    grpc_server.close()


def post(port: int, body: bytes, path: str = "/v1/completions") -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=READ_TIMEOUT_S)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.getheader("content-type", ""), resp.read()
    finally:
        conn.close()


def openai_error(status: int, content_type: str, data: bytes) -> dict:
    """The ``error`` object of an OpenAI-shaped error response."""
    assert content_type.startswith("application/json"), (status, content_type, data[:200])
    error = json.loads(data)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error


def still_answers(port: int, model: str) -> None:
    status, _, data = post(port, json.dumps({"model": model, "prompt": "Hi", "max_tokens": 1}).encode())
    assert status == 200, data[:300]


def answer(sock: socket.socket) -> tuple[int, str, bytes]:
    """The HTTP response waiting on ``sock``: status, content type, body."""
    resp = http.client.HTTPResponse(sock)
    resp.begin()
    try:
        return resp.status, resp.getheader("content-type", ""), resp.read()
    finally:
        resp.close()


def send_until_answered(sock: socket.socket, head: bytes, pieces) -> int:
    """Send ``head``, then ``pieces`` until the server answers (or stops reading); the bytes of
    ``pieces`` sent."""
    sock.sendall(head)
    sent = 0
    for piece in pieces:
        if select.select([sock], [], [], 0)[0]:
            break  # the answer is there: stop sending
        try:
            sock.sendall(piece)
        except (BrokenPipeError, ConnectionResetError):
            break  # the server answered and closed; its answer is still to be read
        sent += len(piece)
    return sent


def test_a_declared_body_over_the_limit_is_refused_before_it_is_sent(served) -> None:
    from opentinker_trainer.inference.openai_http import MAX_BODY_BYTES

    port, model = served
    declared = 50 << 20
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {declared}\r\n\r\n".encode()
    )
    with socket.create_connection(("127.0.0.1", port), timeout=READ_TIMEOUT_S) as sock:
        # Only the headers and 11 bytes of 50 MiB are sent: the answer comes without the rest.
        send_until_answered(sock, head, [b'{"model": "'])
        status, content_type, data = answer(sock)
    assert status == 413, data[:300]
    error = openai_error(status, content_type, data)
    assert error["type"] == "invalid_request_error" and error["code"] == "request_too_large"
    assert error["message"] == (
        f"the request body is {declared} bytes; expected at most {MAX_BODY_BYTES} bytes (send a shorter prompt)"
    )
    still_answers(port, model)


def test_a_chunked_body_over_the_limit_is_refused_while_it_streams(served) -> None:
    from opentinker_trainer.inference.openai_http import MAX_BODY_BYTES

    port, model = served
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    piece = b"a" * (1 << 16)
    chunk = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=READ_TIMEOUT_S) as sock:
        sent = send_until_answered(sock, head, [chunk] * (8 * MAX_BODY_BYTES // len(piece)))
        status, content_type, data = answer(sock)
    assert sent < 8 * MAX_BODY_BYTES  # answered before the whole body was sent
    assert status == 413, data[:300]
    error = openai_error(status, content_type, data)
    assert error["code"] == "request_too_large"
    assert error["message"] == (
        f"the request body is over {MAX_BODY_BYTES} bytes; expected at most {MAX_BODY_BYTES} bytes "
        "(send a shorter prompt)"
    )
    still_answers(port, model)


def too_deep(model: str) -> str:
    return '{"model": "%s", "x": %s}' % (model, "[" * 10_000 + "]" * 10_000)


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (
            lambda m: json.dumps({"model": m, "prompt": "Hi", "seed": 2**70}),
            "seed",
            f"seed: expected an integer in [-2**63, 2**64 - 1], got {2**70}",
        ),
        (
            lambda m: json.dumps({"model": m, "prompt": "Hi", "seed": -(2**64)}),
            "seed",
            f"seed: expected an integer in [-2**63, 2**64 - 1], got {-(2**64)}",
        ),
        (
            lambda m: json.dumps({"model": m, "prompt": "Hi", "max_tokens": 10**30}),
            "max_tokens",
            "sampling.max_tokens: the prompt has ",
        ),
        (
            lambda m: json.dumps({"model": m, "prompt": "Hi", "n": 10**30}),
            "n",
            f"sampling.n: expected an integer in [1, 64], got {10**30}",
        ),
        (
            lambda m: json.dumps({"model": m, "prompt": "Hi", "temperature": "hot"}),
            "temperature",
            "temperature: expected a number, got 'hot'",
        ),
        (
            lambda m: json.dumps({"model": m, "prompt": "Hi", "stop": [1]}),
            "stop",
            "stop: expected a string or a list of strings, got [1]",
        ),
        (
            lambda m: '{"model": "%s", "prompt": "Hi", "temperature": NaN}' % m,
            None,
            "the request body: NaN is not JSON; expected a finite number",
        ),
        (
            too_deep,
            None,
            "the request body: 1:{column}: expected mappings and lists nested at most 64 levels deep (max_depth), "
            "got a deeper one",
        ),
        (lambda m: '{"model": ', None, "the request body: 1:11: expected JSON: Expecting value"),
        (lambda m: "[1, 2]", None, "the request body: expected a JSON object, got a list"),
    ],
    ids=["seed-past-64-bits", "seed-below-64-bits", "huge-max-tokens", "huge-n", "temperature-text", "stop-number",
         "nan", "10k-deep", "not-json", "not-an-object"],
)  # fmt: skip
def test_bad_bodies_are_400_in_the_openai_shape(served, body, param, message) -> None:
    port, model = served
    text = body(model)
    message = message.format(column=too_deep(model).index("[") + 64)  # the 65th level: the 64th [
    for path in ("/v1/completions", "/v1/chat/completions"):
        status, content_type, data = post(port, text.encode(), path)
        assert status == 400, (path, data[:300])
        error = openai_error(status, content_type, data)
        assert error["type"] == "invalid_request_error"
        if path == "/v1/chat/completions" and "prompt" in text:
            continue  # a chat request has no prompt: refused for its messages or its settings
        assert error["param"] == param and error["message"].startswith(message), error
    still_answers(port, model)


def test_an_error_that_names_a_message_field_sets_param(served) -> None:
    port, model = served
    body = {"model": model, "messages": [{"role": "wizard", "content": "Hi"}], "max_tokens": 1}
    status, content_type, data = post(port, json.dumps(body).encode(), "/v1/chat/completions")
    error = openai_error(status, content_type, data)
    assert status == 400 and error["message"].startswith("messages[0].role: "), error
    assert error["param"] == "messages[0].role", error
