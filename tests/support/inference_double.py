"""A TEST DOUBLE of InferenceService on a real gRPC server (no model, no torch): it records each
call's ``authorization`` header, on a plaintext port and a TLS port at once."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent import futures

import grpc

from opentinker.inference.v1 import inference_pb2, inference_pb2_grpc


class RecordingInference(inference_pb2_grpc.InferenceServiceServicer):
    """Records each call's authorization (``seen``) and name (``calls``)."""

    def __init__(self) -> None:
        self.seen: list[str | None] = []
        self.calls: list[str] = []

    def _record(self, call: str, context) -> None:
        self.seen.append(dict(context.invocation_metadata()).get("authorization"))
        self.calls.append(call)

    def ListAdapters(self, request, context):
        self._record("ListAdapters", context)
        return inference_pb2.ListAdaptersResponse(model="m")

    def Generate(self, request, context):
        """One empty sample under the adapter asked for."""
        self._record("Generate", context)
        return inference_pb2.GenerateResponse(model="m", adapter=request.adapter)


@contextlib.contextmanager
def serve_recording_inference(certs) -> Iterator[tuple[RecordingInference, int, int]]:
    """(servicer, plaintext port, TLS port) on 127.0.0.1; the TLS port uses ``certs``' server pair."""
    servicer = RecordingInference()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, server)
    plain = server.add_insecure_port("127.0.0.1:0")
    creds = grpc.ssl_server_credentials([(certs.server_key.read_bytes(), certs.server_cert.read_bytes())])
    secure = server.add_secure_port("127.0.0.1:0", creds)
    server.start()
    try:
        yield servicer, plain, secure
    finally:
        server.stop(None)
