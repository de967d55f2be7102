"""The HTTP face of `forge-rl serve` driven by the real tinker SDK, as a user's script drives it, and
by raw HTTP for what the SDK never sends (malformed requests, a pending future seen from outside).

The server runs in its own thread and asyncio loop (the SDK runs its own loop in a background
thread); `FakeBackend` stands in for the meshes and computes checkable values: every logprob is
-0.5, a sample is the prompt reversed.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

tinker = pytest.importorskip("tinker")

from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_proto_response

from forge_rl.service.backend import (
    ForwardBackwardResult,
    LoraSpec,
    RequestRefused,
    SampledSequence,
    SampleResult,
    SampleSpec,
    SavedWeights,
    TrainingDatum,
)
from forge_rl.service.futures import FutureTable
from forge_rl.service.server import ServiceLimits, ServiceServer, build_app

KEY = "tml-test"
BASE = "fake/base-model"
LOGPROB = -0.5


@dataclass
class Call:
    what: str
    model_id: str | None
    detail: object = None


@dataclass
class FakeBackend:
    """The meshes' stand-in: logprobs are -0.5 per token, a sample is the prompt reversed (cut to
    max_tokens), a saved path names the model and the version."""

    base_model: str = BASE
    max_context_length: int = 128
    tokenizer_id: str = "fake/tokenizer"
    calls: list[Call] = field(default_factory=list)
    models: dict[str, LoraSpec] = field(default_factory=dict)
    version: int = 0
    hold: asyncio.Event | None = None
    """Set by a test (on the server's loop): forward_backward and sample wait on it."""
    entered: threading.Event = field(default_factory=threading.Event)

    async def _maybe_hold(self) -> None:
        if self.hold is not None:
            self.entered.set()
            await self.hold.wait()

    async def create_model(self, lora: LoraSpec) -> str:
        model_id = f"model-{len(self.models)}"
        self.models[model_id] = lora
        self.calls.append(Call("create_model", model_id, lora))
        return model_id

    async def forward_backward(
        self, model_id, data: list[TrainingDatum], loss_fn, loss_fn_config, backward
    ) -> ForwardBackwardResult:
        self.calls.append(Call("forward_backward" if backward else "forward", model_id, [d.tokens for d in data]))
        await self._maybe_hold()
        outputs = []
        for d in data:
            weights = d.inputs.get("weights", np.ones(len(d.tokens), dtype=np.float32))
            outputs.append(
                {
                    "logprobs": np.full(len(d.tokens), LOGPROB, dtype=np.float32),
                    "elementwise_loss": (-LOGPROB * weights).astype(np.float32),
                }
            )
        return ForwardBackwardResult(outputs, {"loss:sum": float(sum(o["elementwise_loss"].sum() for o in outputs))})

    async def optim_step(self, model_id, step) -> dict[str, float]:
        self.calls.append(Call("optim_step", model_id, step))
        return {"learning_rate": step.learning_rate}

    async def save_for_sampler(self, model_id, name, kind) -> SavedWeights:
        self.version += 1
        self.calls.append(Call("save_for_sampler", model_id, kind))
        return SavedWeights(f"tinker://{model_id}/sampler_weights/{name or self.version}", self.version)

    async def sample(self, model_path, spec: SampleSpec) -> SampleResult:
        self.calls.append(Call("sample", None, model_path))
        await self._maybe_hold()
        tokens = list(reversed(spec.prompt))[: spec.max_tokens]
        seq = SampledSequence(tokens, [LOGPROB] * len(tokens), "length", [self.version] * len(tokens))
        prompt_logprobs = [None] + [LOGPROB] * (len(spec.prompt) - 1) if spec.prompt_logprobs else None
        return SampleResult([seq] * spec.num_samples, prompt_logprobs)

    async def save_state(self, model_id, name) -> SavedWeights:
        self.calls.append(Call("save_state", model_id, name))
        return SavedWeights(f"tinker://{model_id}/weights/{name}", self.version)

    async def load_state(self, model_id, path, with_optimizer) -> None:
        self.calls.append(Call("load_state", model_id, (path, with_optimizer)))

    def model_info(self, model_id) -> LoraSpec:
        if model_id not in self.models:
            raise RequestRefused(f"model_id={model_id!r}: no such model", status=404)
        return self.models[model_id]

    async def unload_model(self, model_id) -> None:
        self.calls.append(Call("unload_model", model_id))
        del self.models[model_id]


class ServerThread:
    """The service in a thread of its own, with its own asyncio loop."""

    def __init__(self, backend: FakeBackend, limits: ServiceLimits) -> None:
        self.backend = backend
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="service", daemon=True)
        self.thread.start()

        async def start() -> ServiceServer:
            server = ServiceServer(build_app(backend, api_key=KEY, limits=limits))
            await server.start()
            return server

        self.server = self.call(start())
        self.url = self.server.url

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    def hold(self) -> None:
        """From now on the fake's forward_backward and sample wait until `release`."""

        async def make() -> None:
            self.backend.entered.clear()
            self.backend.hold = asyncio.Event()

        self.call(make())

    def release(self) -> None:
        async def release() -> None:
            assert self.backend.hold is not None
            self.backend.hold.set()
            self.backend.hold = None

        self.call(release())

    def close(self) -> None:
        self.call(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


# A model's queue waits for a missing seq_id far longer than any test runs: a request whose seq_id
# was not passed over would hang its test, not slow it.
LIMITS = ServiceLimits(max_body_bytes=1 << 20, poll_wait_s=0.2, seq_gap_wait_s=600.0)


@pytest.fixture(scope="module")
def served():
    server = ServerThread(FakeBackend(), LIMITS)
    yield server
    server.close()


@pytest.fixture(scope="module")
def service(served):
    client = tinker.ServiceClient(base_url=served.url, api_key=KEY)
    yield client
    client.close("success").result(timeout=30)


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens),
        loss_fn_inputs={"target_tokens": [t + 1 for t in tokens], "weights": [1.0] * len(tokens)},
    )


# --- the SDK, as a user calls it --------------------------------------------------------------


def test_a_user_loop_trains_saves_and_samples_through_the_sdk(served, service):
    training = service.create_lora_training_client(base_model=BASE, rank=8).result(timeout=60)
    assert served.backend.models[training.model_id].rank == 8
    info = training.get_info()
    assert (info.lora_rank, info.model_data.model_name, info.model_data.tokenizer_id) == (8, BASE, "fake/tokenizer")

    out = training.forward_backward([datum([1, 2, 3]), datum([4, 5])], "cross_entropy").result(timeout=60)
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[LOGPROB] * 3, [LOGPROB] * 2]
    assert out.metrics == {"loss:sum": pytest.approx(2.5)}
    step = training.optim_step(tinker.AdamParams(learning_rate=1e-4)).result(timeout=60)
    assert step.metrics == {"learning_rate": pytest.approx(1e-4)}

    forward = training.forward([datum([7, 8])], "cross_entropy").result(timeout=60)
    assert forward.loss_fn_outputs[0]["logprobs"].tolist() == [LOGPROB] * 2
    mine = [c.what for c in served.backend.calls if c.model_id == training.model_id]
    assert mine == ["create_model", "forward_backward", "optim_step", "forward"]

    with pytest.warns(DeprecationWarning):
        sampler = training.save_weights_and_get_sampling_client(name="after-step-1").result(timeout=60)
    result = sampler.sample(
        prompt=types.ModelInput.from_ints([4, 5, 6]), num_samples=2, sampling_params=types.SamplingParams(max_tokens=4)
    ).result(timeout=60)
    assert [s.tokens for s in result.sequences] == [[6, 5, 4], [6, 5, 4]]
    assert [s.logprobs for s in result.sequences] == [[LOGPROB] * 3] * 2
    assert len({s.sequence_id for s in result.sequences}) == 2
    saved = f"tinker://{training.model_id}/sampler_weights/1"
    assert served.backend.calls[-1] == Call("sample", None, saved)

    assert sampler.compute_logprobs(types.ModelInput.from_ints([4, 5, 6])).result(timeout=60) == [
        None,
        LOGPROB,
        LOGPROB,
    ]

    per_model = served.server.metrics()["per_model"][training.model_id]
    assert per_model["forward_backward"] == 1 and per_model["optim_step"] == 1 and per_model["forward"] == 1


def test_the_async_variants_run_the_same_loop(served, service):
    async def loop() -> tuple:
        training = await service.create_lora_training_client(base_model=BASE, rank=4)
        fb_future = training.forward_backward([datum([1, 2])], "cross_entropy")
        optim_future = training.optim_step(tinker.AdamParams(learning_rate=2e-4))
        out, step = await fb_future, await optim_future
        sampler = await training.save_weights_and_get_sampling_client()
        sample = await sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 1, types.SamplingParams(max_tokens=2))
        logprobs = await sampler.compute_logprobs(types.ModelInput.from_ints([1, 2]))
        return out, step, sample, logprobs

    out, step, sample, logprobs = asyncio.run(loop())
    assert out.loss_fn_outputs[0]["logprobs"].tolist() == [LOGPROB, LOGPROB]
    assert step.metrics == {"learning_rate": pytest.approx(2e-4)}
    assert sample.sequences[0].tokens == [3, 2]
    assert logprobs == [None, LOGPROB]


def test_a_saved_state_loads_into_a_new_training_client_and_a_named_sampler_path_samples(served, service):
    training = service.create_lora_training_client(base_model=BASE, rank=16).result(timeout=60)
    state = training.save_state("ckpt-1").result(timeout=60)
    assert state.path == f"tinker://{training.model_id}/weights/ckpt-1"

    resumed = service.create_training_client_from_state_with_optimizer(state.path).result(timeout=60)
    assert resumed.get_info().lora_rank == 16
    backend_id = [c.model_id for c in served.backend.calls if c.what == "load_state"][-1]
    assert served.backend.calls[-1] == Call("load_state", backend_id, (state.path, True))
    resumed.forward_backward([datum([3, 4])], "cross_entropy").result(timeout=60)
    assert served.backend.calls[-1] == Call("forward_backward", backend_id, [[3, 4]])

    named = training.save_weights_for_sampler("final").result(timeout=60)
    assert named.path == f"tinker://{training.model_id}/sampler_weights/final"
    by_path = service.create_sampling_client(model_path=named.path).result(timeout=60)
    assert by_path.get_base_model() == BASE
    by_path.sample(types.ModelInput.from_ints([9]), 1, types.SamplingParams(max_tokens=1)).result(timeout=60)
    assert served.backend.calls[-1] == Call("sample", None, named.path)

    base = service.create_sampling_client(base_model=BASE).result(timeout=60)
    assert base.sample(types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=8)).result(
        timeout=60
    ).sequences[0].tokens == [2, 1]
    assert served.backend.calls[-1] == Call("sample", None, None)


def test_a_training_runs_saves_are_listed_as_the_sdks_rest_client_reads_them(served, service):
    training = service.create_lora_training_client(base_model=BASE, rank=8).result(timeout=60)
    state = training.save_state("listed-1").result(timeout=60)
    sampler = training.save_weights_for_sampler("listed-final").result(timeout=60)
    rest = tinker.RestClient(base_url=served.url, api_key=KEY)

    listed = rest.list_checkpoints(training.model_id).result(timeout=60)
    assert [(c.checkpoint_type, c.checkpoint_id, c.tinker_path) for c in listed.checkpoints] == [
        ("training", "weights/listed-1", state.path),
        ("sampler", "sampler_weights/listed-final", sampler.path),
    ]
    run = rest.get_training_run(training.model_id).result(timeout=60)
    assert (run.training_run_id, run.base_model, run.is_lora, run.lora_rank) == (training.model_id, BASE, True, 8)
    assert (run.last_checkpoint.tinker_path, run.last_sampler_checkpoint.tinker_path) == (state.path, sampler.path)
    assert rest.get_training_run_by_tinker_path(state.path).result(timeout=60).training_run_id == training.model_id

    newest = rest.list_user_checkpoints(limit=1).result(timeout=60)  # every run's saves, newest first
    assert [c.tinker_path for c in newest.checkpoints] == [sampler.path]
    assert newest.cursor.total_count >= 2 and (newest.cursor.offset, newest.cursor.limit) == (0, 1)
    every = rest.list_user_checkpoints(limit=100).result(timeout=60)
    assert {state.path, sampler.path} <= {c.tinker_path for c in every.checkpoints}
    runs = rest.list_training_runs(limit=50).result(timeout=60)
    assert training.model_id in {r.training_run_id for r in runs.training_runs}

    with pytest.raises(tinker.NotFoundError, match="training_run_id='no-such-run'"):
        rest.list_checkpoints("no-such-run").result(timeout=60)
    with pytest.raises(tinker.NotFoundError, match="does not serve publishing"):
        rest.publish_checkpoint_from_tinker_path(state.path).result(timeout=60)


def test_a_refused_loss_reaches_the_user_naming_the_supported_ones_and_the_client_goes_on(served, service):
    training = service.create_lora_training_client(base_model=BASE, rank=8).result(timeout=60)
    with pytest.raises(
        tinker.BadRequestError, match="loss_fn='gspo'.*cross_entropy, importance_sampling, ppo, cispo, dro"
    ):
        training.forward_backward([datum([1, 2])], "gspo").result(timeout=60)
    # The refused request's seq_id is passed over: the next one runs.
    training.forward_backward([datum([5, 6])], "cross_entropy").result(timeout=60)
    assert served.backend.calls[-1] == Call("forward_backward", training.model_id, [[5, 6]])


def test_a_sampler_for_another_base_model_is_refused(service):
    with pytest.raises(tinker.BadRequestError, match=f"base_model='other/model'.*serves '{BASE}'"):
        service.create_sampling_client(base_model="other/model").result(timeout=60)


# --- raw HTTP: the protocol seen from outside --------------------------------------------------


def post(
    served, path: str, body=None, *, content: bytes | None = None, headers=None, key: str | None = KEY
) -> httpx.Response:
    sent = {"X-API-Key": key} if key is not None else {}
    return httpx.post(
        served.url + path,
        json=body if content is None else None,
        content=content,
        headers={**sent, **(headers or {})},
        timeout=30,
    )


def result_of(served, request_id: str, accept: str = "application/x-protobuf") -> httpx.Response:
    """Poll retrieve_future as the SDK does: a 408 "try again" means poll again (each poll waits
    up to LIMITS.poll_wait_s on the server; 150 of them bound a hung request)."""
    for _ in range(150):
        response = post(served, "/api/v1/retrieve_future", {"request_id": request_id}, headers={"Accept": accept})
        if response.status_code != 408:
            return response
        assert response.json() == {"type": "try_again", "request_id": request_id, "queue_state": "active"}
    raise AssertionError(f"request {request_id} never finished")


def raw_model(served) -> str:
    session = post(served, "/api/v1/create_session", {"tags": [], "user_metadata": None, "sdk_version": "raw"}).json()[
        "session_id"
    ]
    created = post(
        served,
        "/api/v1/create_model",
        {"session_id": session, "model_seq_id": 0, "base_model": BASE, "lora_config": {"rank": 2}},
    )
    return result_of(served, created.json()["request_id"]).json()["model_id"]


def fb_body(model_id: str, seq_id: int, tokens: list[int], loss_fn: str = "cross_entropy") -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum(tokens)], loss_fn=loss_fn),
        model_id=model_id,
        seq_id=seq_id,
    )
    return forward_backward_request_to_proto(request).SerializeToString()


PROTO = {"Content-Type": "application/x-protobuf"}


def test_a_pending_future_answers_try_again_then_its_result_as_protobuf_or_json(served):
    model_id = raw_model(served)
    served.hold()
    submitted = post(served, "/api/v1/forward_backward", content=fb_body(model_id, 1, [1, 2]), headers=PROTO)
    request_id = submitted.json()["request_id"]
    assert served.backend.entered.wait(timeout=30)
    pending = post(
        served, "/api/v1/retrieve_future", {"request_id": request_id}, headers={"Accept": "application/x-protobuf"}
    )
    assert pending.status_code == 408 and pending.json()["type"] == "try_again"
    served.release()

    done = result_of(served, request_id)
    assert done.headers["content-type"] == "application/x-protobuf"
    output = deserialize_proto_response(done.content, types.ForwardBackwardOutput)
    assert output.loss_fn_outputs[0]["logprobs"].tolist() == [LOGPROB, LOGPROB]
    as_json = result_of(served, request_id, accept="application/json").json()
    assert as_json["metrics"] == {"loss:sum": 1.0} and as_json["loss_fn_outputs"][0]["logprobs"]["data"] == [
        LOGPROB,
        LOGPROB,
    ]


def test_one_models_requests_run_in_seq_id_order_whatever_order_they_arrive_in(served):
    model_id = raw_model(served)
    second = post(served, "/api/v1/forward_backward", content=fb_body(model_id, 2, [20, 21]), headers=PROTO).json()[
        "request_id"
    ]
    first = post(served, "/api/v1/forward_backward", content=fb_body(model_id, 1, [10, 11]), headers=PROTO).json()[
        "request_id"
    ]
    for request_id in (second, first):
        assert result_of(served, request_id).status_code == 200
    assert [c.detail for c in served.backend.calls if c.model_id == model_id and c.what == "forward_backward"] == [
        [[10, 11]],
        [[20, 21]],
    ]


def test_a_request_refused_at_once_gives_up_its_seq_id_so_the_next_one_runs(served):
    model_id = raw_model(served)
    refused = post(
        served, "/api/v1/optim_step", {"adam_params": {"learning_rate": -1.0}, "model_id": model_id, "seq_id": 1}
    )
    assert refused.status_code == 400 and refused.json()["field"] == "optim_params.learning_rate"
    undecodable = post(
        served, "/api/v1/optim_step", {"adam_params": {"beta1": "high"}, "model_id": model_id, "seq_id": 2}
    )
    assert undecodable.status_code == 400
    request_id = post(served, "/api/v1/forward_backward", content=fb_body(model_id, 3, [1, 2]), headers=PROTO).json()[
        "request_id"
    ]
    assert result_of(served, request_id).status_code == 200


def test_the_sdk_splits_a_large_forward_backward_into_chunks_the_server_runs_in_order():
    # A body limit of 8 KiB makes the SDK send chunks of at most 4 KiB: two 100-token data each.
    server = ServerThread(FakeBackend(), replace(LIMITS, max_body_bytes=8 << 10))
    client = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    try:
        training = client.create_lora_training_client(base_model=BASE, rank=8).result(timeout=60)
        data = [datum(list(range(i, i + 100))) for i in range(7)]
        out = training.forward_backward(data, "cross_entropy").result(timeout=60)
        calls = [c.detail for c in server.backend.calls if c.what == "forward_backward"]
        assert [len(chunk) for chunk in calls] == [2, 2, 2, 1]
        assert [tokens[0] for chunk in calls for tokens in chunk] == list(range(7))
        assert len(out.loss_fn_outputs) == 7 and out.metrics == {"loss:sum": pytest.approx(350.0)}
    finally:
        client.close("success").result(timeout=30)
        server.close()


def test_samples_past_the_pending_limit_are_429_for_the_sdk_to_back_off():
    server = ServerThread(FakeBackend(), replace(LIMITS, max_pending_samples=1))
    try:
        server.hold()
        sample = {
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1]}]},
            "sampling_params": {"max_tokens": 1},
            "base_model": BASE,
        }
        first = post(server, "/api/v1/asample", sample)
        assert first.status_code == 200
        second = post(server, "/api/v1/asample", sample)
        assert second.status_code == 429 and "max_pending_samples" in second.json()["error"]
        server.release()
        assert result_of(server, first.json()["request_id"]).status_code == 200
        assert post(server, "/api/v1/asample", sample).status_code == 200
    finally:
        server.close()


def test_a_cancelled_sample_fails_its_future_as_cancelled(served):
    served.hold()
    sample = {
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
        "sampling_params": {"max_tokens": 2},
        "base_model": BASE,
        "num_samples": 1,
    }
    submitted = post(served, "/api/v1/asample", sample).json()
    assert len(submitted["sample_sequence_ids"]) == 1
    assert served.backend.entered.wait(timeout=30)
    assert post(served, "/api/v1/cancel_future", {"request_id": submitted["request_id"]}).json()["cancelled"] is True
    failed = result_of(served, submitted["request_id"]).json()
    served.release()
    assert failed["category"] == "user" and "cancelled" in failed["error"]


@pytest.mark.parametrize(
    "path, body, status, field, words",
    [
        ("/api/v1/create_model", b"{not json", 400, "body", "not valid JSON"),
        (
            "/api/v1/optim_step",
            {"adam_params": {"learning_rate": 1e-4}, "model_id": "no-such-model", "seq_id": 1},
            404,
            "model_id",
            "'no-such-model'",
        ),
        (
            "/api/v1/optim_step",
            {"adam_params": {"learning_rate": "fast"}, "model_id": "m", "seq_id": 1},
            400,
            "adam_params.learning_rate",
            "'fast'",
        ),
        (
            "/api/v1/asample",
            {
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1]}]},
                "sampling_params": {},
                "base_model": BASE,
                "num_samples": 0,
            },
            400,
            "num_samples",
            "num_samples=0",
        ),
        (
            "/api/v1/asample",
            {
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, -7]}]},
                "sampling_params": {},
                "base_model": BASE,
            },
            400,
            "prompt.tokens[1]",
            "-7",
        ),
        ("/api/v1/retrieve_future", {"request_id": "req-unknown"}, 404, "request_id", "'req-unknown'"),
        ("/api/v1/save_weights_external", {"model_id": "m", "path": "x"}, 404, "path", "external format"),
        ("/api/v1/no_such_thing", {}, 404, "path", "no such endpoint"),
    ],
)
def test_a_malformed_request_is_a_4xx_whose_body_names_the_field(served, path, body, status, field, words):
    response = post(served, path, content=body) if isinstance(body, bytes) else post(served, path, body)
    assert response.status_code == status, response.text
    error = response.json()
    assert error["field"] == field and words in error["error"] and error["category"] == "user"


def test_an_unsupported_loss_in_a_raw_protobuf_body_is_refused_naming_the_supported_ones(served):
    response = post(
        served,
        "/api/v1/forward_backward",
        content=fb_body(raw_model(served), 1, [1, 2], "stable_reinforce"),
        headers=PROTO,
    )
    assert response.status_code == 400
    assert (
        response.json()["field"] == "loss_fn"
        and "cross_entropy, importance_sampling, ppo, cispo, dro" in response.json()["error"]
    )


def test_a_body_over_the_limit_is_413(served):
    response = post(served, "/api/v1/forward_backward", content=b"\0" * (LIMITS.max_body_bytes + 1), headers=PROTO)
    assert response.status_code == 413 and response.json()["field"] == "body"


def test_the_api_key_is_required_when_the_server_has_one(served):
    assert (
        post(
            served, "/api/v1/create_session", {"tags": [], "user_metadata": None, "sdk_version": "x"}, key=None
        ).status_code
        == 401
    )
    wrong = post(
        served, "/api/v1/create_session", {"tags": [], "user_metadata": None, "sdk_version": "x"}, key="tml-wrong"
    )
    assert wrong.status_code == 401 and "X-API-Key" in wrong.json()["error"] and "tml-test" not in wrong.text
    assert httpx.get(served.url + "/api/v1/healthz", timeout=30).json() == {"status": "ok"}


def test_without_a_server_key_any_key_is_accepted():
    server = ServerThread(FakeBackend(), LIMITS)
    try:

        async def open_server() -> ServiceServer:
            keyless = ServiceServer(build_app(server.backend, api_key=None, limits=LIMITS))
            await keyless.start()
            return keyless

        keyless = server.call(open_server())
        body = json.dumps({"tags": [], "user_metadata": None, "sdk_version": "x"})
        assert httpx.post(keyless.url + "/api/v1/create_session", content=body, timeout=30).status_code == 200
        server.call(keyless.stop())
    finally:
        server.close()


# --- the futures table on its own --------------------------------------------------------------


def test_a_models_queue_waits_out_a_missing_seq_id_then_runs_the_next_and_runs_a_repeat_once():
    ran: list[str] = []

    def op(name: str):
        async def run() -> str:
            ran.append(name)
            return name

        return run

    async def scenario() -> None:
        table = FutureTable(gap_wait_s=0.05)
        third = table.submit("x", op("third"), model_id="m", seq_id=3)
        assert table.submit("x", op("third again"), model_id="m", seq_id=3) == third
        second = table.submit("x", op("second"), model_id="m", seq_id=2)
        # seq_id 1 never comes: after gap_wait_s the queue runs 2, then 3, in order.
        assert (await table.retrieve(third, wait_s=10)).value == "third"
        assert (await table.retrieve(second, wait_s=10)).value == "second"
        # Another body under a taken seq_id is another request (a second client of the model).
        other = table.submit("x", op("other body"), model_id="m", seq_id=3, body=b"other")
        assert other != third and (await table.retrieve(other, wait_s=10)).value == "other body"
        waited = FutureTable(gap_wait_s=1000)
        waited.pass_over("m", 1)
        assert (
            await waited.retrieve(waited.submit("x", op("after the refused"), model_id="m", seq_id=2), wait_s=10)
        ).value == "after the refused"

    asyncio.run(scenario())
    assert ran == ["second", "third", "other body", "after the refused"]


def test_a_fetched_result_is_dropped_after_its_retention_and_an_unclaimed_one_after_longer():
    now = [0.0]

    async def scenario() -> None:
        table = FutureTable(retention_s=10, unclaimed_s=100, clock=lambda: now[0])

        async def answer() -> int:
            return 42

        fetched, unclaimed = table.submit("x", answer), table.submit("x", answer)
        assert (await table.retrieve(fetched, wait_s=5)).value == 42
        await table.retrieve(unclaimed, wait_s=5)
        table._futures[unclaimed].retrieved_at = None  # as if never fetched
        now[0] = 11.0
        table.sweep()
        assert not table.known(fetched) and table.known(unclaimed)
        now[0] = 101.0
        table.sweep()
        assert not table.known(unclaimed)

    asyncio.run(scenario())


def test_a_save_for_sampler_answers_once_its_adapter_is_written_so_a_sample_of_the_path_can_load_it(tmp_path):
    """The meshes' save (MeshBackend on a fake trainer mesh): rank 0 writes the published adapter in
    the background, and a sample of the path may come as soon as the save answers (the cookbook's
    RL loops sample at once), so the save answers only once the write is complete."""
    from forge_rl.models.tiny import TinyModelConfig, create_tiny_model
    from forge_rl.service.config import ServeConfig
    from forge_rl.service.meshes import MeshBackend

    model_dir = create_tiny_model(TinyModelConfig(), tmp_path / "model")
    written: list[int] = []
    writes: list[asyncio.Task] = []

    async def add_tenant(model_id, *args) -> None:
        pass

    async def publish(model_id, version) -> dict:
        async def write() -> None:
            await asyncio.sleep(0.05)
            written.append(version)

        writes.append(asyncio.create_task(write()))
        return {}

    async def wait_for_publish() -> None:
        if writes:
            await writes.pop()

    class Endpoint:  # the trainer mesh of one rank: `call()` answers each rank's value
        def __init__(self, function):
            self.function = function

        async def call(self, *args):
            return {0: await self.function(*args)}

    trainer = SimpleNamespace(
        add_tenant=Endpoint(add_tenant), publish=Endpoint(publish), wait_for_publish=Endpoint(wait_for_publish)
    )

    async def scenario() -> None:
        backend = MeshBackend(ServeConfig(), trainer, None, None, tmp_path, model_dir)
        model_id = await backend.create_model(LoraSpec(rank=32, seed=0))
        for kind in ("snapshot", "inflight"):
            saved = await backend.save_for_sampler(model_id, None, kind)
            assert written[-1:] == [saved.policy_version], (
                f"a {kind} save answered before version {saved.policy_version} was written"
            )

    asyncio.run(scenario())
    assert written == [1, 2]
