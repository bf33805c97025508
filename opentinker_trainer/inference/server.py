"""``opentinker.inference.v1.InferenceService`` over grpc.aio, with health and reflection.

Thin: protobuf in and out, errors mapped to status codes; the work is in
:class:`~opentinker_trainer.inference.runtime.ModelRuntime`. With an ``access`` checker
(:class:`~.access.AccessChecker`) every InferenceService call is checked against the scheduler with
the caller's endpoint token (health and reflection stay open); with ``tls`` the port speaks TLS only.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import tempfile
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from opentinker.inference.v1 import inference_pb2, inference_pb2_grpc

from opentinker_trainer.inference.access import AccessChecker, AccessRefused
from opentinker_trainer.inference.adapters import AdapterNotFound, AdapterRefused, AdaptersBusy
from opentinker_trainer.inference.engine import FINISH_LENGTH, FINISH_STOP, SamplingParams
from opentinker_trainer.inference.policies import (
    BadObservations,
    PolicyBusy,
    PolicyNotFound,
    PolicyRefused,
    PolicyRegistry,
)
from opentinker_trainer.inference.resolve import adapter_not_found, policy_not_found, split_adapter_name
from opentinker_trainer.inference.runtime import BadRequest, Busy, ModelRuntime, Prepared, WrongModel
from opentinker_trainer.inference.serve_tls import ServerTLS
from opentinker_common.net.grpc_options import server_options

__all__ = ["InferenceService", "RunningInferenceServer", "start_inference_server", "check_tls_pair", "SERVICE_NAME"]

SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name
SERVER_OPTIONS = server_options(max_pings_without_data=False)

_FINISH = {FINISH_STOP: inference_pb2.FINISH_REASON_STOP, FINISH_LENGTH: inference_pb2.FINISH_REASON_LENGTH}


class NoModel(Exception):
    """This server holds no language model (an inference task with ``policies_only``): FAILED_PRECONDITION."""


_STATUS = (
    (BadRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (BadObservations, grpc.StatusCode.INVALID_ARGUMENT),
    (PolicyNotFound, grpc.StatusCode.NOT_FOUND),
    (PolicyRefused, grpc.StatusCode.FAILED_PRECONDITION),
    (PolicyBusy, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NoModel, grpc.StatusCode.FAILED_PRECONDITION),
    (WrongModel, grpc.StatusCode.NOT_FOUND),
    (AdapterNotFound, grpc.StatusCode.NOT_FOUND),
    (AdapterRefused, grpc.StatusCode.FAILED_PRECONDITION),
    (AdaptersBusy, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Busy, grpc.StatusCode.RESOURCE_EXHAUSTED),
)


def sampling_from_proto(s: inference_pb2.SamplingParams) -> SamplingParams:
    """Wire sampling settings -> :class:`SamplingParams`, defaults for unset fields."""
    return SamplingParams(
        temperature=float(s.temperature) if s.HasField("temperature") else 1.0,
        top_p=float(s.top_p) if s.HasField("top_p") else 1.0,
        top_k=int(s.top_k),
        max_tokens=int(s.max_tokens) if s.max_tokens else 64,
        stop=tuple(s.stop),
        seed=int(s.seed) if s.HasField("seed") else None,
        n=int(s.n) if s.n else 1,
        ignore_eos=bool(s.ignore_eos),
    )


class InferenceService(inference_pb2_grpc.InferenceServiceServicer):
    """The servicer. ``runtime`` does the work.

    With ``access`` and ``task_id`` (this server's inference task), a caller must be allowed to use
    ``task_id`` (UNAUTHENTICATED / PERMISSION_DENIED / UNAVAILABLE otherwise) and, for a request
    naming an adapter, that adapter's task too (NOT_FOUND otherwise, worded as for an adapter that
    does not exist). ``access=None``: no checks (in-process tests, a server without a scheduler).

    ``runtime`` None: no language model (``policies_only``); Generate and GenerateStream are refused.
    ``policies``: the PPO policies ``Act`` serves (None: Act is refused, FAILED_PRECONDITION).
    """

    def __init__(
        self,
        runtime: ModelRuntime | None,
        *,
        access: AccessChecker | None = None,
        task_id: str = "",
        policies: PolicyRegistry | None = None,
    ) -> None:
        if access is not None and not task_id:
            raise ValueError("task_id: expected the serving task's id when access is checked")
        self.runtime = runtime
        self.access = access
        self.task_id = task_id
        self.policies = policies

    async def _admit(self, context) -> None:
        """The caller may use this server, else AccessRefused."""
        if self.access is not None:
            await self.access.check(context.invocation_metadata(), self.task_id)

    async def _admit_adapter(self, context, adapter: str | None) -> None:
        """The caller may use ``adapter`` (its task: ``<task id>`` or ``<task id>@<step>``), else
        AdapterNotFound (never confirming that it exists)."""
        if self.access is None or not adapter:
            return
        try:
            await self.access.check(context.invocation_metadata(), split_adapter_name(adapter)[0], self.task_id)
        except AccessRefused as exc:
            if exc.code == grpc.StatusCode.PERMISSION_DENIED:
                raise adapter_not_found(adapter) from None
            raise

    def _prepare(self, request) -> Prepared:
        if self.runtime is None:
            raise NoModel(
                "this inference server serves PPO policies only (policies_only: no language model is loaded); "
                "call Act, or generate on a server of a base model"
            )
        which = request.WhichOneof("prompt")
        messages = [(m.role, m.content) for m in request.messages.messages] if which == "messages" else None
        text = request.text if which == "text" else None
        return self.runtime.prepare(
            model=request.model,
            adapter=request.adapter,
            text=text,
            messages=messages,
            params=sampling_from_proto(request.sampling),
        )

    @staticmethod
    async def _abort(context, exc: Exception) -> None:
        if isinstance(exc, AccessRefused):
            await context.abort(exc.code, exc.message)
        for cls, code in _STATUS:
            if isinstance(exc, cls):
                await context.abort(code, str(exc))
        raise exc

    async def Generate(self, request, context):
        try:
            await self._admit(context)
            req = self._prepare(request)
            await self._admit_adapter(context, req.adapter)
            n = req.params.n
            tokens: list[list[int]] = [[] for _ in range(n)]
            logprobs: list[list[float]] = [[] for _ in range(n)]
            texts = [""] * n
            finish = [0] * n
            usage = (0, 0)
            async for ev in self.runtime.run(req):
                if ev.usage is not None:
                    usage = ev.usage
                    continue
                tokens[ev.index].extend(ev.token_ids)
                logprobs[ev.index].extend(ev.logprobs)
                texts[ev.index] += ev.text
                if ev.finish_reason:
                    finish[ev.index] = _FINISH[ev.finish_reason]
        except Exception as exc:  # noqa: BLE001 - mapped or re-raised
            await self._abort(context, exc)
        return inference_pb2.GenerateResponse(
            samples=[
                inference_pb2.Sample(
                    index=i, text=texts[i], token_ids=tokens[i], logprobs=logprobs[i], finish_reason=finish[i]
                )
                for i in range(n)
            ],
            usage=inference_pb2.Usage(prompt_tokens=usage[0], completion_tokens=usage[1]),
            model=self.runtime.model_name,
            adapter=req.adapter or "",
        )

    async def GenerateStream(self, request, context):
        try:
            await self._admit(context)
            req = self._prepare(request)
            await self._admit_adapter(context, req.adapter)
            events = self.runtime.run(req)
            first = await anext(events)
        except Exception as exc:  # noqa: BLE001 - mapped or re-raised
            await self._abort(context, exc)
        try:
            ev = first
            while True:
                msg = inference_pb2.GenerateStreamResponse(
                    index=ev.index, text=ev.text, token_ids=ev.token_ids, logprobs=ev.logprobs
                )
                if ev.finish_reason:
                    msg.finish_reason = _FINISH[ev.finish_reason]
                if ev.usage is not None:
                    msg.usage.prompt_tokens, msg.usage.completion_tokens = ev.usage
                yield msg
                try:
                    ev = await anext(events)
                except StopAsyncIteration:
                    return
        finally:
            await events.aclose()  # a cancelled client: stop generating, free the slot

    async def Act(self, request, context):
        try:
            await self._admit(context)
            if self.policies is None:
                raise NoModel("this inference server does not serve policies")
            if request.policy and self.access is not None:
                try:
                    await self.access.check(context.invocation_metadata(), request.policy, self.task_id)
                except AccessRefused as exc:
                    if exc.code == grpc.StatusCode.PERMISSION_DENIED:
                        raise PolicyNotFound(policy_not_found(request.policy)) from None
                    raise
            shape, actions, values, step = await asyncio.to_thread(
                self.policies.act, request.policy, list(request.observations.shape), list(request.observations.values)
            )
        except grpc.RpcError as exc:  # asking the scheduler about the policy's task failed
            detail = exc.details() if hasattr(exc, "details") else str(exc)
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"policy {request.policy!r}: cannot ask the scheduler about it: {detail}"
            )
        except Exception as exc:  # noqa: BLE001 - mapped or re-raised
            await self._abort(context, exc)
        return inference_pb2.ActResponse(
            actions=inference_pb2.Tensor(shape=shape, values=actions), values=values, policy=request.policy, step=step
        )

    async def ListAdapters(self, request, context):
        try:
            await self._admit(context)
            if self.runtime is None:
                return inference_pb2.ListAdaptersResponse()
            loaded = self.runtime.registry.list()
            visible = await asyncio.gather(*(self._sees(context, a.name) for a in loaded))
        except Exception as exc:  # noqa: BLE001 - mapped or re-raised
            await self._abort(context, exc)
        out = inference_pb2.ListAdaptersResponse(
            model=self.runtime.model_name,
            max_resident_adapters=self.runtime.registry.max_resident,
            context_length=self.runtime.context_length,
        )
        for a, seen in zip(loaded, visible):
            if not seen:
                continue  # another owner's adapter (loaded for an admin): not even its name
            # The folder's name only (step_N): the node's absolute paths are not the caller's business.
            msg = out.adapters.add(
                name=a.name, path=os.path.basename(os.path.normpath(a.path)), size_bytes=a.size_bytes, in_use=a.in_use
            )
            msg.load_time.FromNanoseconds(int(a.load_time * 1e9))
            msg.last_used_time.FromNanoseconds(int(a.last_used_time * 1e9))
        return out

    async def _sees(self, context, adapter: str) -> bool:
        try:
            await self._admit_adapter(context, adapter)
        except AdapterNotFound:
            return False
        return True


@dataclass
class RunningInferenceServer:
    server: grpc.aio.Server
    port: int
    health: object
    #: Whether the port speaks TLS (clients then dial ``https://host:port``).
    tls: bool = False
    access: AccessChecker | None = None
    runtime: ModelRuntime | None = None

    async def stop(self, grace: float = 2.0) -> None:
        await _maybe_await(self.health.enter_graceful_shutdown())
        await self.server.stop(grace)
        if self.runtime is not None:
            await self.runtime.stop_engine()
        if self.access is not None:
            await self.access.close()


async def start_inference_server(
    runtime: ModelRuntime | None,
    *,
    host: str = "0.0.0.0",
    port: int = 0,
    tls: ServerTLS | None = None,
    access: AccessChecker | None = None,
    task_id: str = "",
    policies: PolicyRegistry | None = None,
) -> RunningInferenceServer:
    """Serve ``runtime`` (None: no language model) and ``policies`` (``Act``) on ``host:port``
    (0 = any free port); returns the handle with the port.

    Args:
        tls: ``(certificate chain PEM, private key PEM)``: the port speaks TLS only
            (:func:`~.tls.read_server_tls`); ``None``: plaintext.
        access, task_id: check every InferenceService call against the scheduler with the
            caller's key, as a user of inference task ``task_id`` (:class:`InferenceService`).
            The handle's ``stop`` closes ``access``.

    Raises:
        OSError: the port cannot be bound ("in use, or not a valid address"), or gRPC refused the
            TLS credentials ("TLS credentials refused").
        ValueError: ``access`` without ``task_id``; ``tls`` whose key does not match its
            certificate, or that is not PEM ("TLS credentials refused: ...").
    """
    if tls is not None:
        check_tls_pair(tls)  # before binding: gRPC only says "Handshaker factory creation failed" in its log
    server = grpc.aio.server(options=SERVER_OPTIONS)
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(
        InferenceService(runtime, access=access, task_id=task_id, policies=policies), server
    )
    bound, health_servicer = await serve_with_health(server, SERVICE_NAME, host=host, port=port, tls=tls)
    return RunningInferenceServer(
        server=server, port=bound, health=health_servicer, tls=tls is not None, access=access, runtime=runtime
    )


async def serve_with_health(
    server: grpc.aio.Server, service_name: str, *, host: str, port: int, tls: ServerTLS | None
) -> tuple[int, object]:
    """Add health (``""`` and ``service_name`` SERVING once started) and reflection to
    ``server`` (its service already added), bind ``host:port`` (0 = any free port; TLS when
    ``tls``) and start it. The inference and training servers share this.

    Returns:
        ``(bound port, health servicer)``.

    Raises:
        OSError: the port cannot be bound ("in use, or not a valid address"), or gRPC refused the
            TLS credentials on a free port ("TLS credentials refused by gRPC"); the server is stopped.
    """
    health_servicer = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((service_name, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    try:
        if tls is None:
            bound = server.add_insecure_port(f"{host}:{port}")
        else:
            bound = server.add_secure_port(f"{host}:{port}", grpc.ssl_server_credentials([(tls[1], tls[0])]))
    except RuntimeError:
        bound = 0
    if bound == 0:
        await server.stop(None)
        if tls is not None and _port_is_free(host, port):
            raise OSError(
                f"cannot listen on {host}:{port} with TLS: TLS credentials refused by gRPC (the port itself is free; "
                "check that --serve-tls-key is the private key of --serve-tls-cert and a type gRPC supports)"
            )
        raise OSError(f"cannot listen on {host}:{port} (in use, or not a valid address)")
    await server.start()
    for name in ("", service_name):
        await _maybe_await(health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING))
    return bound, health_servicer


def check_tls_pair(tls: ServerTLS) -> None:
    """Load ``(certificate chain PEM, private key PEM)`` into an :class:`ssl.SSLContext`, as gRPC
    will, so that a key that does not belong to the certificate is a clear error.

    Raises:
        ValueError: "TLS credentials refused: the private key does not match the certificate"
            (or the reason OpenSSL gives).
    """
    cert, key = tls
    with tempfile.TemporaryDirectory(prefix="opentinker-tls-") as folder:  # load_cert_chain reads files only
        paths = []
        for name, data in (("cert.pem", cert), ("key.pem", key)):
            path = os.path.join(folder, name)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            paths.append(path)
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(certfile=paths[0], keyfile=paths[1])
        except ssl.SSLError as exc:
            reason = (
                "the private key does not match the certificate"
                if "KEY_VALUES_MISMATCH" in str(exc)
                else (exc.reason or str(exc))
            )
            raise ValueError(f"TLS credentials refused: {reason} (--serve-tls-cert / --serve-tls-key)") from None


def _port_is_free(host: str, port: int) -> bool:
    """Whether a plain socket can bind ``host:port`` now (port 0 always can)."""
    if port == 0:
        return True
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return False
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        try:
            probe.bind(address)
        except OSError:
            return False
    return True


async def _maybe_await(value) -> None:
    if asyncio.iscoroutine(value):
        await value
