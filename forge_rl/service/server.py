"""The HTTP face of `forge-rl serve`: the Tinker API, as the official `tinker` SDK calls it, over a
`ServiceBackend`.

`build_app` makes the FastAPI app; `ServiceServer` runs it with uvicorn in the caller's asyncio
loop (the meshes' controller runs its Monarch calls in that loop too). The app reads each request
with the SDK's own types (`forge_rl.service.wire`), refuses a malformed one with a 4xx naming the
field, the value and the fix, and runs the work as a future (`forge_rl.service.futures`).

The protocol the app asks the SDK for (/api/v1/client/config) is the SDK's simplest: API keys
(no JWT exchange), httpx transport, plain protobuf forward_backward bodies, one retrieve_future
poll per request. What the SDK can call and this server does not serve answers 404 with a JSON
body naming it: never 501, which the SDK retries for minutes as a server fault.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hmac
import logging
import socket
import uuid
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pydantic
import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from tinker import types
from tinker.types.try_again_response import TryAgainResponse

from forge_rl.service import wire
from forge_rl.service.backend import LoraSpec, RequestRefused, ServiceBackend
from forge_rl.service.futures import FutureTable, Outcome

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=pydantic.BaseModel)

API_KEY_HEADER = "X-API-Key"
"""The header the SDK's ApiKeyAuthProvider puts the key in."""


@dataclass(frozen=True)
class ServiceLimits:
    max_body_bytes: int = 64 * 2**20
    """A larger request body is refused with 413 (after zstd inflation for a compressed one)."""
    poll_wait_s: float = 5.0
    """How long a retrieve_future waits for the result before answering "try again"."""
    result_retention_s: float = 60.0
    """How long a result stays after the client fetched it (for a poll repeated in transit)."""
    unclaimed_result_s: float = 3600.0
    """How long a result nobody fetched stays."""
    seq_gap_wait_s: float = 10.0
    """How long a training model's queue waits for a missing seq_id before running the next."""
    max_num_samples: int = 128
    """The most samples one sample request may ask for."""
    max_pending_samples: int = 4096
    """Sample requests beyond this many unfinished are answered 429: the SDK backs off and resends."""


_UNSERVED: dict[str, str] = {
    "/api/v1/retrieve_futures": "session-wide completion polling (this server answers each request's retrieve_future)",
    "/api/v1/join_sampling_session": "clone ids for unpickled sampling clients (the SDK picks one itself here)",
    "/api/v1/create_custom_loss": "server-side custom losses (forward_backward_custom runs the loss client-side)",
    "/api/v1/auth/token": "JWT exchange (this server takes API keys)",
    "/api/v1/save_weights_external": "saving weights in an external format",
    "/api/v1/copy_weights": "copying weights between projects",
    "/api/v1/training_runs": "publishing, TTLs, deleting and exporting checkpoints",
    "/api/v1/checkpoints": "checkpoint storage usage",
    "/api/v1/sessions": "listing and searching sessions",
    "/api/v1/audit": "audit logs",
    "/api/v1/billing": "billing",
}
"""Paths the SDK knows that this server does not serve, with what they are for."""


@dataclass
class _Sampler:
    base_model: str
    model_path: str | None


@dataclass(frozen=True)
class _Reply:
    """A finished operation's result: its JSON, and its protobuf where the SDK reads one."""

    json: Callable[[], dict[str, Any]]
    proto: bytes | None = None


def _json(model: Any) -> _Reply:
    return _Reply(lambda: model.model_dump(mode="json", exclude_none=True))


@dataclass
class _Service:
    backend: ServiceBackend
    api_key: str | None
    limits: ServiceLimits
    futures: FutureTable
    sessions: dict[str, bool] = field(default_factory=dict)
    """Session id -> finished."""
    samplers: dict[str, _Sampler] = field(default_factory=dict)
    samplers_by_seq: dict[tuple[str, int], str] = field(default_factory=dict)
    models: dict[str, str] = field(default_factory=dict)
    """The client's model id -> the backend's (they differ for a model created by loading a checkpoint,
    whose id the SDK derives itself)."""
    checkpoints: defaultdict[str, dict[str, types.Checkpoint]] = field(default_factory=lambda: defaultdict(dict))
    """The backend's model id -> its saved states and sampler weights by tinker path, in the order saved."""
    last_request: dict[str, datetime.datetime] = field(default_factory=dict)
    """The backend's model id -> when a request last reached it."""
    requests: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)
    per_model: defaultdict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))

    def backend_model(self, model_id: str, field_name: str = "model_id") -> str:
        backend_id = self.models.get(model_id)
        if backend_id is None:
            raise wire.refuse(
                field_name,
                model_id,
                "no training model of that id on this server (never created, unloaded, or created on another server)",
                "use the model_id create_lora_training_client returned",
                status=404,
            )
        return backend_id

    def training_run(self, run_id: str) -> str:
        """The backend's model id of a training run, named by the client's model id or by the id
        its tinker:// paths carry (the SDK's ParsedCheckpointTinkerPath.training_run_id)."""
        if run_id in self.models.values():
            return run_id
        return self.backend_model(run_id, "training_run_id")

    def record_checkpoint(self, backend_id: str, path: str) -> None:
        """A save's path as the Checkpoint the listing endpoints return (a path saved again, such as
        the in-flight sampler weights, is listed once, at its latest time)."""
        parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(path)
        saved = self.checkpoints[backend_id]
        saved.pop(path, None)
        saved[path] = types.Checkpoint(
            checkpoint_id=parsed.checkpoint_id, checkpoint_type=parsed.checkpoint_type, time=_now(), tinker_path=path
        )

    def metrics(self) -> dict[str, Any]:
        return {
            "requests": dict(self.requests),
            "refused": dict(self.refused),
            "per_model": {model: dict(counts) for model, counts in self.per_model.items()},
            "models": len(self.models),
            "sessions": sum(1 for finished in self.sessions.values() if not finished),
            "samplers": len(self.samplers),
            **self.futures.counts(),
        }


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _page(items: list, limit: int, offset: int) -> tuple[list, types.Cursor]:
    if limit < 1 or offset < 0:
        raise wire.refuse(
            "limit" if limit < 1 else "offset",
            limit if limit < 1 else offset,
            "must be >= 1 (limit) and >= 0 (offset)",
            "pass limit >= 1 and offset >= 0",
        )
    return items[offset : offset + limit], types.Cursor(offset=offset, limit=limit, total_count=len(items))


def service_of(app: FastAPI) -> _Service:
    return app.state.service


def metrics(app: FastAPI) -> dict[str, Any]:
    """Requests served and refused, by endpoint and by training model, and the futures held."""
    return service_of(app).metrics()


def _error(status: int, message: str, field_name: str | None = None, category: str = "user") -> JSONResponse:
    body: dict[str, Any] = {"error": message, "category": category}
    if field_name is not None:
        body["field"] = field_name
    # The SDK's HTTP layer retries 408, 409, 429 and 5xx; this tells it not to retry the rest.
    return JSONResponse(
        body, status_code=status, headers={"x-should-retry": "false"} if status not in (408, 409, 429) else None
    )


async def _body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise wire.refuse(
            "body",
            f"{declared} bytes",
            f"larger than the {limit} bytes this server takes",
            "send fewer data per request",
            status=413,
        )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise wire.refuse(
                "body",
                f"over {limit} bytes",
                f"larger than the {limit} bytes this server takes",
                "send fewer data per request",
                status=413,
            )
        chunks.append(chunk)
    return b"".join(chunks)


def _source_model(path: str, field_name: str) -> str:
    """The backend model id a tinker://<model_id>/... path was minted for."""
    if not path.startswith("tinker://") or not path[len("tinker://") :].split("/", 1)[0]:
        raise wire.refuse(
            field_name,
            path,
            "not a tinker://<model_id>/... path this server minted",
            "pass the path save_state or save_weights_for_sampler returned",
        )
    return path[len("tinker://") :].split("/", 1)[0]


def build_app(backend: ServiceBackend, api_key: str | None = None, limits: ServiceLimits = ServiceLimits()) -> FastAPI:
    """The Tinker API over `backend`. With `api_key`, every request but /api/v1/healthz must carry
    it in the X-API-Key header; without, any key (the SDK always sends one) is accepted."""
    service = _Service(
        backend=backend,
        api_key=api_key,
        limits=limits,
        futures=FutureTable(
            poll_wait_s=limits.poll_wait_s,
            retention_s=limits.result_retention_s,
            unclaimed_s=limits.unclaimed_result_s,
            gap_wait_s=limits.seq_gap_wait_s,
        ),
    )
    app = FastAPI(title="forge-rl serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    base_model, max_context = backend.base_model, backend.max_context_length

    @app.exception_handler(RequestRefused)
    async def _refused(request: Request, exc: RequestRefused) -> JSONResponse:
        service.refused[request.url.path.rsplit("/", 1)[-1]] += 1
        return _error(exc.status, str(exc), getattr(exc, "field", None))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 405:
            return _error(
                405,
                f"{request.method} {request.url.path}: this endpoint takes another method; call it as the tinker SDK does",
                "method",
            )
        return _error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", "path")

    def authorized(request: Request) -> None:
        if api_key is None:
            return
        sent = request.headers.get(API_KEY_HEADER)
        if sent is None or not hmac.compare_digest(sent.encode(), api_key.encode()):
            problem = "missing" if sent is None else "not this server's key"
            raise RequestRefused(
                f"{API_KEY_HEADER}: the API key is {problem}; pass the server's key as tinker.ServiceClient(api_key=...) or TINKER_API_KEY",
                status=401,
            )

    api = Depends(authorized)

    def future_response(request_id: str, model_id: str | None = None, **extra: Any) -> dict[str, Any]:
        return types.UntypedAPIFuture(request_id=request_id, model_id=model_id, **extra).model_dump(
            mode="json", exclude_none=True
        )

    def count(kind: str, model_id: str | None = None) -> None:
        service.requests[kind] += 1
        if model_id is not None:
            service.per_model[model_id][kind] += 1

    async def on_model(
        kind: str, model_id: str, seq_id: int | None, body: bytes, run: Callable[[str], Awaitable[_Reply]]
    ) -> dict[str, Any]:
        """Queue `run(backend_model_id)` on the client's training model, in seq_id order."""
        try:
            backend_id = service.backend_model(model_id)
        except RequestRefused:
            service.futures.pass_over(model_id, seq_id)
            raise
        count(kind, model_id)  # known models only: a client's made-up ids grow no table
        service.last_request[backend_id] = _now()
        request_id = service.futures.submit(kind, lambda: run(backend_id), model_id=model_id, seq_id=seq_id, body=body)
        return future_response(request_id, model_id)

    def passing_over(raw: bytes, parse: Callable[[], M]) -> M:
        """`parse()` of a JSON body for a training model: refused, its seq_id (where the body
        names one) is passed over."""
        try:
            return parse()
        except RequestRefused:
            ids = wire.model_and_seq(raw)
            if ids is not None:
                service.futures.pass_over(*ids)
            raise

    async def model_request(model: type[M], request: Request) -> tuple[M, bytes]:
        """The request for a training model as `model`, and its body."""
        raw = await _body(request, limits.max_body_bytes)
        return passing_over(raw, lambda: wire.parse_json(model, raw)), raw

    def parsed_for_model(model_id: str, seq_id: int | None, parse: Callable[[], Any]) -> Any:
        """`parse()`, passing over the request's seq_id when it is refused, so the model's queue
        does not wait for it."""
        try:
            return parse()
        except RequestRefused:
            if model_id:
                service.futures.pass_over(model_id, seq_id)
            raise

    # --- the client's setup ---------------------------------------------------------------------

    @app.get("/api/v1/healthz")
    async def healthz() -> dict[str, Any]:
        return types.HealthResponse(status="ok").model_dump(mode="json")

    @app.post("/api/v1/client/config", dependencies=[api])
    async def client_config(request: Request) -> dict[str, Any]:
        wire.parse_json(types.ClientConfigRequest, await _body(request, limits.max_body_bytes))
        count("client_config")
        return types.ClientConfigResponse(
            pjwt_auth_enabled=False,
            use_pyqwest_transport=False,
            proto_compress_fwdbwd=False,
            sample_use_retrieve_futures=False,
            custom_loss_server_side=False,
            sample_join_sampling_session=False,
            # The SDK splits a forward_backward into chunks of about this many bytes: well under the body limit.
            fwdbwd_max_chunk_bytes_count=min(
                types.ClientConfigResponse().fwdbwd_max_chunk_bytes_count, limits.max_body_bytes // 2
            ),
        ).model_dump(mode="json")

    @app.post("/api/v1/client/dynamic_config", dependencies=[api])
    async def client_dynamic_config(request: Request) -> dict[str, Any]:
        await _body(request, limits.max_body_bytes)
        return types.ClientDynamicConfigResponse(sample_cancel_enabled=True).model_dump(mode="json")

    @app.post("/api/v1/create_session", dependencies=[api])
    async def create_session(request: Request) -> dict[str, Any]:
        wire.parse_json(types.CreateSessionRequest, await _body(request, limits.max_body_bytes))
        count("create_session")
        session_id = f"session-{uuid.uuid4().hex[:16]}"
        service.sessions[session_id] = False
        return types.CreateSessionResponse(session_id=session_id).model_dump(mode="json", exclude_none=True)

    def known_session(session_id: str, field_name: str = "session_id") -> None:
        if session_id not in service.sessions:
            raise wire.refuse(
                field_name,
                session_id,
                "no session of that id on this server",
                "create the client anew (tinker.ServiceClient)",
                status=404,
            )

    @app.post("/api/v1/session_heartbeat", dependencies=[api])
    async def session_heartbeat(request: Request) -> dict[str, Any]:
        body = wire.parse_json(types.SessionHeartbeatRequest, await _body(request, limits.max_body_bytes))
        known_session(body.session_id)
        if service.sessions[body.session_id]:
            raise wire.refuse(
                "session_id",
                body.session_id,
                "the session has finished",
                "create a new tinker.ServiceClient",
                status=410,
            )
        return types.SessionHeartbeatResponse().model_dump(mode="json")

    @app.post("/api/v1/sessions/{session_id}/finish", dependencies=[api])
    async def finish_session(session_id: str, request: Request) -> dict[str, Any]:
        await _body(request, limits.max_body_bytes)
        known_session(session_id)
        service.sessions[session_id] = True
        count("finish_session")
        return {}

    @app.get("/api/v1/get_server_capabilities", dependencies=[api])
    async def get_server_capabilities() -> dict[str, Any]:
        return types.GetServerCapabilitiesResponse(
            supported_models=[
                types.SupportedModel(
                    model_name=base_model, max_context_length=max_context, trainable=True, sampleable=True
                )
            ]
        ).model_dump(mode="json", exclude_none=True)

    @app.post("/api/v1/telemetry", dependencies=[api])
    async def telemetry(request: Request) -> dict[str, Any]:
        await _body(request, limits.max_body_bytes)  # the SDK's own diagnostics: accepted and dropped
        return types.TelemetryResponse(status="accepted").model_dump(mode="json")

    # --- training models ------------------------------------------------------------------------

    @app.post("/api/v1/create_model", dependencies=[api])
    async def create_model(request: Request) -> dict[str, Any]:
        body = wire.parse_json(types.CreateModelRequest, await _body(request, limits.max_body_bytes))
        count("create_model")
        known_session(body.session_id)
        lora = wire.lora_spec(body, base_model)

        async def run() -> _Reply:
            model_id = await backend.create_model(lora)
            service.models[model_id] = model_id
            return _json(types.CreateModelResponse(model_id=model_id))

        return future_response(service.futures.submit("create_model", run))

    def info(model_id: str, spec: LoraSpec) -> types.GetInfoResponse:
        return types.GetInfoResponse(
            type="get_info",
            model_id=model_id,
            model_data=types.ModelData(model_name=base_model, tokenizer_id=backend.tokenizer_id),
            is_lora=True,
            lora_rank=spec.rank,
            model_name=base_model,
        )

    @app.post("/api/v1/get_info", dependencies=[api])
    async def get_info(request: Request) -> dict[str, Any]:
        body = wire.parse_json(types.GetInfoRequest, await _body(request, limits.max_body_bytes))
        spec = backend.model_info(service.backend_model(body.model_id))
        count("get_info", body.model_id)
        return info(body.model_id, spec).model_dump(mode="json", exclude_none=True)

    @app.post("/api/v1/weights_info", dependencies=[api])
    async def weights_info(request: Request) -> dict[str, Any]:
        body = wire.parse_json(_WeightsInfoRequest, await _body(request, limits.max_body_bytes))
        count("weights_info")
        spec = backend.model_info(_source_model(body.tinker_path, "tinker_path"))
        return types.WeightsInfoResponse(
            base_model=base_model,
            is_lora=True,
            lora_rank=spec.rank,
            train_unembed=spec.train_unembed,
            train_mlp=spec.train_mlp,
            train_attn=spec.train_attn,
        ).model_dump(mode="json", exclude_none=True)

    async def forward_backward_request(request: Request, forward_only: bool | None) -> dict[str, Any]:
        raw = wire.decompress(
            await _body(request, limits.max_body_bytes), request.headers.get("content-encoding"), limits.max_body_bytes
        )
        if wire.PROTO_CONTENT_TYPE in request.headers.get("content-type", ""):
            msg = wire.read_forward_backward_proto(raw)
            model_id, seq_id = msg.model_id, msg.seq_id or None
            call = parsed_for_model(
                model_id, seq_id, lambda: wire.forward_backward_from_proto(msg, max_context, forward_only=forward_only)
            )
        else:
            body = passing_over(raw, lambda: wire.read_forward_backward_json(raw))
            model_id, seq_id = body.model_id, body.seq_id
            call = parsed_for_model(
                model_id,
                seq_id,
                lambda: wire.forward_backward_from_json(body, max_context, forward_only=bool(forward_only)),
            )

        async def run(backend_id: str) -> _Reply:
            result = await backend.forward_backward(
                backend_id, call.data, call.loss_fn, call.loss_fn_config, backward=not call.forward_only
            )
            proto = wire.forward_backward_output_proto(result, len(call.data))
            return _Reply(lambda: wire.forward_backward_output_json(result, len(call.data)), proto)

        return await on_model(
            "forward" if call.forward_only else "forward_backward", call.model_id, call.seq_id, raw, run
        )

    @app.post("/api/v1/forward_backward", dependencies=[api])
    async def forward_backward(request: Request) -> dict[str, Any]:
        return await forward_backward_request(request, None)

    @app.post("/api/v1/forward", dependencies=[api])
    async def forward(request: Request) -> dict[str, Any]:
        return await forward_backward_request(request, True)

    @app.post("/api/v1/optim_step", dependencies=[api])
    async def optim_step(request: Request) -> dict[str, Any]:
        body, raw = await model_request(types.OptimStepRequest, request)
        step = parsed_for_model(body.model_id, body.seq_id, lambda: wire.adam_step(body))

        async def run(backend_id: str) -> _Reply:
            return _json(types.OptimStepResponse(metrics=await backend.optim_step(backend_id, step)))

        return await on_model("optim_step", body.model_id, body.seq_id, raw, run)

    @app.post("/api/v1/save_weights_for_sampler", dependencies=[api])
    async def save_weights_for_sampler(request: Request) -> dict[str, Any]:
        body, raw = await model_request(types.SaveWeightsForSamplerRequest, request)
        with_session = body.path is None or body.sampling_session_seq_id is not None

        async def run(backend_id: str) -> _Reply:
            saved = await backend.save_for_sampler(backend_id, body.path, body.kind)
            service.record_checkpoint(backend_id, saved.path)
            sampling_session_id = None
            if with_session:
                sampling_session_id = f"sampler-{uuid.uuid4().hex[:16]}"
                service.samplers[sampling_session_id] = _Sampler(base_model, saved.path)
            return _json(
                types.SaveWeightsForSamplerResponseInternal(
                    path=saved.path, sampling_session_id=sampling_session_id, type="save_weights_for_sampler"
                )
            )

        return await on_model("save_weights_for_sampler", body.model_id, body.seq_id, raw, run)

    @app.post("/api/v1/save_weights", dependencies=[api])
    async def save_weights(request: Request) -> dict[str, Any]:
        body, raw = await model_request(types.SaveWeightsRequest, request)

        def name() -> str:
            if not body.path:
                raise wire.refuse("path", body.path, "a saved state needs a name", "pass save_state(name=...)")
            return body.path

        checkpoint = parsed_for_model(body.model_id, body.seq_id, name)

        async def run(backend_id: str) -> _Reply:
            saved = await backend.save_state(backend_id, checkpoint)
            service.record_checkpoint(backend_id, saved.path)
            return _json(types.SaveWeightsResponse(path=saved.path, type="save_weights"))

        return await on_model("save_weights", body.model_id, body.seq_id, raw, run)

    @app.post("/api/v1/load_weights", dependencies=[api])
    async def load_weights(request: Request) -> dict[str, Any]:
        body, raw = await model_request(types.LoadWeightsRequest, request)
        if body.model_id is not None:
            _source_model(body.path, "path")

            async def run(backend_id: str) -> _Reply:
                await backend.load_state(backend_id, body.path, body.optimizer)
                return _json(types.LoadWeightsResponse(path=body.path, model_id=body.model_id, type="load_weights"))

            return await on_model("load_weights", body.model_id, body.seq_id, raw, run)
        return await create_from_checkpoint(body)

    async def create_from_checkpoint(body: types.LoadWeightsRequest) -> dict[str, Any]:
        """A new training model holding a saved state: the SDK's create_training_client_from_state,
        which names the model itself (`<session_id>:train:<model_seq_id>`)."""
        if body.session_id is None or body.model_seq_id is None:
            raise wire.refuse(
                "model_id",
                None,
                "a load names the model to load into",
                "pass model_id, or session_id and model_seq_id for a new model",
            )
        known_session(body.session_id)
        check = wire.check_base_model
        check("base_model", body.base_model, base_model)
        if body.optimizer_config is not None:
            wire.check_adam("optimizer_config.type", body.optimizer_config.type)
        spec = backend.model_info(_source_model(body.path, "path"))
        model_id = f"{body.session_id}:train:{body.model_seq_id}"
        count("load_weights", model_id)

        async def run() -> _Reply:
            if model_id not in service.models:
                new_id = await backend.create_model(spec)
                service.models[model_id] = new_id
            await backend.load_state(service.models[model_id], body.path, body.optimizer)
            return _json(types.LoadWeightsResponse(path=body.path, model_id=model_id, type="load_weights"))

        return future_response(service.futures.submit("load_weights", run, model_id=model_id), model_id)

    @app.post("/api/v1/unload_model", dependencies=[api])
    async def unload_model(request: Request) -> dict[str, Any]:
        body, raw = await model_request(types.UnloadModelRequest, request)

        async def run(backend_id: str) -> _Reply:
            await backend.unload_model(backend_id)
            service.models.pop(body.model_id, None)
            service.futures.forget_model(body.model_id)
            return _json(types.UnloadModelResponse(model_id=body.model_id, type="unload_model"))

        return await on_model("unload_model", body.model_id, None, raw, run)

    # --- sampling -------------------------------------------------------------------------------

    @app.post("/api/v1/create_sampling_session", dependencies=[api])
    async def create_sampling_session(request: Request) -> dict[str, Any]:
        body = wire.parse_json(types.CreateSamplingSessionRequest, await _body(request, limits.max_body_bytes))
        count("create_sampling_session")
        known_session(body.session_id)
        wire.check_base_model("base_model", body.base_model, base_model)
        if body.model_path is not None:
            _source_model(body.model_path, "model_path")
        key = (body.session_id, body.sampling_session_seq_id)
        sampler_id = service.samplers_by_seq.get(key)
        if sampler_id is None:  # a repeat is the SDK retrying the same request
            sampler_id = service.samplers_by_seq[key] = f"sampler-{uuid.uuid4().hex[:16]}"
            service.samplers[sampler_id] = _Sampler(base_model, body.model_path)
        return types.CreateSamplingSessionResponse(sampling_session_id=sampler_id).model_dump(mode="json")

    def sampler(sampler_id: str, field_name: str = "sampling_session_id") -> _Sampler:
        found = service.samplers.get(sampler_id)
        if found is None:
            raise wire.refuse(
                field_name,
                sampler_id,
                "no sampling session of that id on this server",
                "create the sampling client anew",
                status=404,
            )
        return found

    @app.get("/api/v1/samplers/{sampler_id}", dependencies=[api])
    async def get_sampler(sampler_id: str) -> dict[str, Any]:
        found = sampler(sampler_id, "sampler_id")
        return types.GetSamplerResponse(
            sampler_id=sampler_id, base_model=found.base_model, model_path=found.model_path
        ).model_dump(mode="json")

    @app.post("/api/v1/asample", dependencies=[api])
    async def asample(request: Request) -> dict[str, Any]:
        body = wire.parse_json(types.SampleRequest, await _body(request, limits.max_body_bytes))
        count("asample")
        if body.sampling_session_id is not None:
            model_path = sampler(body.sampling_session_id).model_path
        else:
            wire.check_base_model("base_model", body.base_model, base_model)
            model_path = body.model_path
            if model_path is not None:
                _source_model(model_path, "model_path")
        call = wire.sample_call(body, max_context, limits.max_num_samples)
        if service.futures.pending("asample") >= limits.max_pending_samples:
            raise RequestRefused(
                f"asample: {limits.max_pending_samples} sample requests are unfinished (ServiceLimits.max_pending_samples); send this one again shortly",
                status=429,
            )

        async def run() -> _Reply:
            result = await backend.sample(model_path, call.spec)
            proto = wire.sample_response_proto(result, call)
            return _Reply(lambda: wire.sample_response_json(result, call), proto)

        request_id = service.futures.submit("asample", run)
        return future_response(
            request_id, sample_sequence_ids=[f"{request_id}:{i}" for i in range(call.spec.num_samples)]
        )

    # --- futures --------------------------------------------------------------------------------

    @app.post("/api/v1/retrieve_future", dependencies=[api])
    async def retrieve_future(request: Request) -> Response:
        body = wire.parse_json(types.FutureRetrieveRequest, await _body(request, limits.max_body_bytes))
        if not service.futures.known(body.request_id):
            raise wire.refuse(
                "request_id",
                body.request_id,
                "no such request on this server (never issued, or its result was fetched and dropped)",
                "send the request again",
                status=404,
            )
        outcome = await service.futures.retrieve(body.request_id)
        if outcome is None:
            # 408 with a try_again body: the SDK polls again at once (the wait was here).
            return JSONResponse(
                TryAgainResponse(request_id=body.request_id, queue_state="active").model_dump(mode="json"),
                status_code=408,
            )
        return _render(outcome, wire.PROTO_CONTENT_TYPE in request.headers.get("accept", ""))

    @app.post("/api/v1/cancel_future", dependencies=[api])
    async def cancel_future(request: Request) -> dict[str, Any]:
        body = wire.parse_json(_CancelRequest, await _body(request, limits.max_body_bytes))
        count("cancel_future")
        return {"request_id": body.request_id, "cancelled": service.futures.cancel(body.request_id)}

    # --- training runs and their checkpoints (the SDK's RestClient) ----------------------------

    def training_run(run_id: str) -> types.TrainingRun:
        backend_id = service.training_run(run_id)
        saved = list(service.checkpoints[backend_id].values())
        last = {
            kind: next((c for c in reversed(saved) if c.checkpoint_type == kind), None)
            for kind in ("training", "sampler")
        }
        return types.TrainingRun(
            training_run_id=backend_id,
            base_model=base_model,
            model_owner="forge-rl serve",
            is_lora=True,
            lora_rank=backend.model_info(backend_id).rank,
            last_request_time=service.last_request.get(backend_id, _now()),
            last_checkpoint=last["training"],
            last_sampler_checkpoint=last["sampler"],
        )

    @app.get("/api/v1/training_runs", dependencies=[api])
    async def list_training_runs(limit: int = 20, offset: int = 0) -> dict[str, Any]:
        count("list_training_runs")
        runs, cursor = _page(sorted(set(service.models.values())), limit, offset)
        return types.TrainingRunsResponse(training_runs=[training_run(r) for r in runs], cursor=cursor).model_dump(
            mode="json"
        )

    @app.get("/api/v1/training_runs/{run_id}", dependencies=[api])
    async def get_training_run(run_id: str) -> dict[str, Any]:
        count("get_training_run")
        return training_run(run_id).model_dump(mode="json")

    @app.get("/api/v1/training_runs/{run_id}/checkpoints", dependencies=[api])
    async def list_checkpoints(run_id: str) -> dict[str, Any]:
        count("list_checkpoints")
        saved = list(service.checkpoints[service.training_run(run_id)].values())
        return types.CheckpointsListResponse(checkpoints=saved).model_dump(mode="json")

    @app.get("/api/v1/checkpoints", dependencies=[api])
    async def list_user_checkpoints(limit: int = 100, offset: int = 0) -> dict[str, Any]:
        count("list_user_checkpoints")
        every = sorted(
            (c for saved in service.checkpoints.values() for c in saved.values()), key=lambda c: c.time, reverse=True
        )
        page, cursor = _page(every, limit, offset)
        return types.CheckpointsListResponse(checkpoints=page, cursor=cursor).model_dump(mode="json")

    # --- what is not served ---------------------------------------------------------------------

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"], dependencies=[api])
    async def unserved(path: str, request: Request) -> JSONResponse:
        full = "/" + path
        count("unserved")
        what = next(
            (reason for prefix, reason in _UNSERVED.items() if full == prefix or full.startswith(prefix + "/")), None
        )
        if what is not None:
            return _error(404, f"{request.method} {full}: forge-rl serve does not serve {what}", "path")
        return _error(
            404,
            f"{request.method} {full}: no such endpoint; forge-rl serve serves the Tinker API's /api/v1 training and sampling calls",
            "path",
        )

    return app


class _WeightsInfoRequest(pydantic.BaseModel):
    """The body RestClient.get_weights_info_by_tinker_path sends (the SDK has no type for it)."""

    model_config = pydantic.ConfigDict(extra="forbid")
    tinker_path: str


class _CancelRequest(pydantic.BaseModel):
    """The body the SDK's cancel of an abandoned sample sends (the SDK has no type for it)."""

    model_config = pydantic.ConfigDict(extra="forbid")
    request_id: str


def _render(outcome: Outcome, accept_proto: bool) -> Response:
    if outcome.error is not None:
        body = types.RequestFailedResponse(error=outcome.error, category=outcome.category or "server")
        return JSONResponse(body.model_dump(mode="json"))
    reply: _Reply = outcome.value
    if accept_proto and reply.proto is not None:
        return Response(reply.proto, media_type=wire.PROTO_CONTENT_TYPE)
    return JSONResponse(reply.json())


class _Uvicorn(uvicorn.Server):
    """uvicorn without its signal handlers: the process that runs the server owns its signals."""

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[override]
        yield


class ServiceServer:
    """`app` served by uvicorn in the running asyncio loop, on `host`:`port` (0: a free port)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        self.app = app
        self.host = host
        self._port = port
        self._server: _Uvicorn | None = None
        self._task: asyncio.Task[None] | None = None
        self._socket: socket.socket | None = None
        self._bound_port: int | None = None

    @property
    def port(self) -> int:
        if self._bound_port is None:
            raise RuntimeError("ServiceServer.port: the server has not started; await start() first")
        return self._bound_port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def metrics(self) -> dict[str, Any]:
        return metrics(self.app)

    async def start(self) -> None:
        """Bind the port and serve; returns once the server accepts connections."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self._port))
        sock.listen(128)
        sock.setblocking(False)
        self._socket = sock
        self._bound_port = sock.getsockname()[1]
        # log_config=None: the process's logging stays as its owner set it up.
        config = uvicorn.Config(
            self.app,
            lifespan="off",
            log_config=None,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=5,
        )
        self._server = _Uvicorn(config)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises why it did not start
                raise RuntimeError(f"the service's HTTP server on {self.host}:{self.port} exited while starting")
            await asyncio.sleep(0.01)
        logger.info("forge-rl serve: the Tinker API on %s", self.url)

    async def stop(self) -> None:
        """Stop serving and cancel the operations still running."""
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task
        await service_of(self.app).futures.close()
        if self._socket is not None:
            self._socket.close()
