"""The Tinker API's wire format, read into `forge_rl.service.backend`'s types and written back.

The official `tinker` SDK defines the format: its pydantic request types parse the JSON bodies, its
`tinker_public_pb2` messages carry the protobuf ones (a forward_backward request; the
ForwardBackwardOutput and SampleResponse results, the only ones the SDK asks for as protobuf).
Every writer here is the inverse of an SDK reader (`tinker.proto.response_conv`), every reader the
inverse of an SDK writer (`tinker.proto.request_conv`), so a round trip through both gives back
what was sent.

A request the service cannot carry out raises `FieldRefused`: its message names the field, the
value and the fix, and the face answers it with a 4xx.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import pydantic
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.types._pydantic_types.forward_backward_input import ForwardBackwardInput as _ForwardBackwardInputJson

from forge_rl.service.backend import (
    LOSS_FUNCTIONS,
    AdamStep,
    ForwardBackwardResult,
    LoraSpec,
    RequestRefused,
    SampleResult,
    SampleSpec,
    TopK,
    TrainingDatum,
)

PROTO_CONTENT_TYPE = "application/x-protobuf"

M = TypeVar("M", bound=pydantic.BaseModel)


class FieldRefused(RequestRefused):
    """A refused request whose fault lies in one field: `field` names it (dotted, with indices) for
    the error body beside the message."""

    def __init__(self, field: str, message: str, status: int = 400) -> None:
        super().__init__(message, status)
        self.field = field


def refuse(field: str, value: Any, problem: str, fix: str, status: int = 400) -> FieldRefused:
    """The refusal of `field` = `value`: what is wrong with it and what to send instead."""
    shown = repr(value)
    if len(shown) > 200:
        shown = shown[:200] + "..."
    return FieldRefused(field, f"{field}={shown}: {problem}; {fix}", status)


# --- JSON requests ------------------------------------------------------------------------------


def parse_json(model: type[M], body: bytes) -> M:
    """`body` as the SDK's pydantic request `model`; bad JSON or a field of the wrong type is
    refused naming the field, what was sent and what the type wants."""
    try:
        raw = json.loads(body) if body else None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FieldRefused(
            "body", f"body: not valid JSON ({e}); send the JSON of tinker.types.{model.__name__}"
        ) from None
    if not isinstance(raw, dict):
        raise refuse(
            "body", raw, "the body must be a JSON object", f"send the JSON object of tinker.types.{model.__name__}"
        )
    try:
        return model.model_validate(raw)
    except pydantic.ValidationError as e:
        errors = e.errors()
        problems = "; ".join(
            f"{_field(err['loc'])}: {err['msg']} (got {_short(err.get('input'))})" for err in errors[:5]
        )
        field = _field(errors[0]["loc"])
        raise FieldRefused(
            field, f"{model.__name__}: {problems}; fix these fields as tinker.types.{model.__name__} defines them"
        ) from None


def model_and_seq(body: bytes) -> tuple[str, int | None] | None:
    """The `model_id` and `seq_id` of a JSON body that was refused, where it names them, so the
    model's queue passes over the seq_id rather than waiting for it."""
    try:
        raw = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("model_id"), str):
        return None
    seq_id = raw.get("seq_id")
    return raw["model_id"], seq_id if isinstance(seq_id, int) and not isinstance(seq_id, bool) else None


def _field(loc: tuple[int | str, ...]) -> str:
    """A pydantic error location as the client's field path: the members a union was tried as
    (`AdamParams`, `function-after[...]`) are pydantic's, not the client's."""
    parts = [str(p) for p in loc if not (isinstance(p, str) and (p[:1].isupper() or "[" in p))]
    return ".".join(parts) or "body"


def _short(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 120 else shown[:120] + "..."


def model_input_tokens(model_input: types.ModelInput, field: str, max_context_length: int) -> list[int]:
    """The token ids of a text-only model input (each chunk an EncodedTextChunk)."""
    tokens: list[int] = []
    for i, chunk in enumerate(model_input.chunks):
        if not isinstance(chunk, types.EncodedTextChunk):
            raise _non_text_chunk(f"{field}.chunks[{i}]", getattr(chunk, "type", type(chunk).__name__))
        tokens.extend(int(t) for t in chunk.tokens)
    return _checked_tokens(tokens, field, max_context_length)


def _non_text_chunk(field: str, kind: str) -> FieldRefused:
    return refuse(
        field,
        kind,
        "forge-rl serve serves a text model and takes token chunks only (EncodedTextChunk)",
        "send the input as token ids, e.g. tinker.ModelInput.from_ints(tokens)",
    )


def _checked_tokens(tokens: list[int], field: str, max_context_length: int) -> list[int]:
    if not tokens:
        raise refuse(field, [], "the input holds no tokens", "send at least one token id")
    bad = next((i for i, t in enumerate(tokens) if t < 0), None)
    if bad is not None:
        raise refuse(
            f"{field}.tokens[{bad}]",
            tokens[bad],
            "token ids are never negative",
            "send the tokenizer's ids (0 or more)",
        )
    if len(tokens) > max_context_length:
        raise refuse(
            field,
            f"{len(tokens)} tokens",
            f"longer than the served model's context of {max_context_length} tokens",
            f"send at most {max_context_length} tokens",
        )
    return tokens


def lora_spec(request: types.CreateModelRequest, base_model: str) -> LoraSpec:
    """The training model a create_model request asks for: a LoRA adapter over the served base."""
    check_base_model("base_model", request.base_model, base_model)
    lora = request.lora_config
    if lora is None:
        raise refuse(
            "lora_config",
            None,
            "forge-rl serve trains LoRA adapters only",
            "set lora_config (create_lora_training_client does)",
        )
    if lora.rank < 1:
        raise refuse("lora_config.rank", lora.rank, "a LoRA rank is 1 or more", "pass rank=8, 16, 32, ...")
    if not (lora.train_attn or lora.train_mlp or lora.train_unembed):
        raise refuse(
            "lora_config", lora.model_dump(), "no layer is trained", "set one of train_attn, train_mlp, train_unembed"
        )
    check_adam("optimizer_config.type", request.optimizer_config.type)
    return LoraSpec(
        rank=lora.rank,
        seed=lora.seed,
        train_attn=lora.train_attn,
        train_mlp=lora.train_mlp,
        train_unembed=lora.train_unembed,
    )


def check_base_model(field: str, asked: str | None, served: str) -> None:
    if asked is not None and asked != served:
        raise refuse(field, asked, f"this server serves {served!r} only", f"pass base_model={served!r}")


def check_adam(field: str, kind: str) -> None:
    if kind != "adamw":
        raise refuse(
            field,
            kind,
            "forge-rl serve steps with AdamW only",
            "leave the optimizer at its default (AdamW) and pass tinker.AdamParams",
        )


def adam_step(request: types.OptimStepRequest) -> AdamStep:
    params = request.optim_params
    if not isinstance(params, types.AdamParams):
        check_adam("optim_params.type", getattr(params, "type", type(params).__name__))
    assert isinstance(params, types.AdamParams)
    for name in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"):
        value = getattr(params, name)
        if not math.isfinite(value) or value < 0:
            raise refuse(f"optim_params.{name}", value, "must be a finite number, 0 or more", f"pass a valid {name}")
    if not (params.beta1 < 1 and params.beta2 < 1):
        raise refuse(
            "optim_params.beta1/beta2",
            (params.beta1, params.beta2),
            "Adam's betas are below 1",
            "pass e.g. beta1=0.9, beta2=0.95",
        )
    return AdamStep(
        learning_rate=params.learning_rate,
        beta1=params.beta1,
        beta2=params.beta2,
        eps=params.eps,
        weight_decay=params.weight_decay,
        grad_clip_norm=params.grad_clip_norm,
    )


# --- forward_backward requests ------------------------------------------------------------------


@dataclass(frozen=True)
class ForwardBackwardCall:
    """A forward_backward (or forward) request in the backend's terms."""

    model_id: str
    seq_id: int | None
    data: list[TrainingDatum]
    loss_fn: str
    loss_fn_config: dict[str, float] | None
    forward_only: bool


_PROTO_DTYPES: dict[int, np.dtype] = {
    pb.DTYPE_FLOAT32: np.dtype(np.float32),
    pb.DTYPE_INT64: np.dtype(np.int64),
    pb.DTYPE_INT32: np.dtype(np.int32),
}

_INT_INPUTS = frozenset({"target_tokens"})
"""Loss inputs that hold token ids (int64); every other input is float32."""


def decompress(body: bytes, content_encoding: str | None, max_bytes: int) -> bytes:
    """The body as sent before its Content-Encoding (none, or zstd as the SDK writes it), refused
    when it inflates past `max_bytes`."""
    encoding = (content_encoding or "identity").strip().lower()
    if encoding == "identity":
        return body
    if encoding != "zstd":
        raise refuse(
            "Content-Encoding",
            content_encoding,
            "only zstd-compressed or plain bodies are read",
            "send the body plain or zstd-compressed",
        )
    import zstandard

    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body)) as reader:
            inflated = reader.read(max_bytes + 1)
    except zstandard.ZstdError as e:
        raise refuse(
            "body",
            f"{len(body)} bytes",
            f"not a valid zstd frame ({e})",
            "compress the body with zstd, or send it plain",
        ) from None
    if len(inflated) > max_bytes:
        raise refuse(
            "body",
            f"over {max_bytes} bytes inflated",
            "the request is larger than this server takes",
            "send fewer data per request",
            status=413,
        )
    return inflated


def read_forward_backward_proto(body: bytes) -> pb.ForwardBackwardRequest:
    """The protobuf `ForwardBackwardRequest` `tinker.proto.request_conv` writes, undecoded: its
    model_id and seq_id place it in the model's queue even when its data are refused."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # the protobuf runtimes (upb, python) raise different DecodeError types
        raise refuse(
            "body",
            f"{len(body)} bytes",
            f"not a tinker ForwardBackwardRequest protobuf ({type(e).__name__})",
            "send the body the tinker SDK writes (Content-Type application/x-protobuf)",
        ) from None
    return msg


def forward_backward_from_proto(
    msg: pb.ForwardBackwardRequest, max_context_length: int, *, forward_only: bool | None = None
) -> ForwardBackwardCall:
    """The request in the backend's terms; `forward_only` overrides the message's flag (the
    /forward path)."""
    if msg.loss_fn_config_v2:
        config_items: dict[str, Any] = {
            k: (v.text if v.WhichOneof("value") == "text" else v.number) for k, v in msg.loss_fn_config_v2.items()
        }
    else:
        config_items = dict(msg.loss_fn_config)
    check_loss_fn(msg.loss_fn)
    data = [_datum_from_proto(d, f"data[{i}]", max_context_length) for i, d in enumerate(msg.data)]
    return _forward_backward_call(
        msg.model_id,
        msg.seq_id or None,
        data,
        msg.loss_fn,
        config_items,
        msg.forward_only if forward_only is None else forward_only,
    )


def read_forward_backward_json(body: bytes) -> ForwardBackwardJson:
    """The JSON form of a forward_backward or forward request, as SDKs before the protobuf body
    sent it."""
    return parse_json(ForwardBackwardJson, body)


def forward_backward_from_json(
    request: ForwardBackwardJson, max_context_length: int, *, forward_only: bool
) -> ForwardBackwardCall:
    fb_input = request.forward_backward_input or request.forward_input
    if fb_input is None:
        raise refuse(
            "forward_backward_input",
            None,
            "the request holds no input",
            "send forward_backward_input (or forward_input)",
        )
    check_loss_fn(fb_input.loss_fn)
    data = []
    for i, datum in enumerate(fb_input.data):
        field = f"data[{i}]"
        tokens = model_input_tokens(datum.model_input, f"{field}.model_input", max_context_length)
        inputs = {
            name: _dense(
                np.asarray(td.data),
                td.dtype,
                td.shape,
                td.sparse_crow_indices,
                td.sparse_col_indices,
                f"{field}.loss_fn_inputs.{name}",
            )
            for name, td in datum.loss_fn_inputs.items()
        }
        data.append(_datum(tokens, inputs, field))
    return _forward_backward_call(
        request.model_id,
        request.seq_id,
        data,
        fb_input.loss_fn,
        dict(fb_input.loss_fn_config or {}),
        forward_only or request.forward_only,
    )


class ForwardBackwardJson(pydantic.BaseModel):
    """The JSON body of a forward_backward (`forward_backward_input`) or forward (`forward_input`) request."""

    model_config = pydantic.ConfigDict(protected_namespaces=(), extra="ignore")
    forward_backward_input: _ForwardBackwardInputJson | None = None
    forward_input: _ForwardBackwardInputJson | None = None
    model_id: str
    seq_id: int | None = None
    forward_only: bool = False


def _forward_backward_call(
    model_id: str,
    seq_id: int | None,
    data: list[TrainingDatum],
    loss_fn: str,
    config: Mapping[str, Any],
    forward_only: bool,
) -> ForwardBackwardCall:
    if not model_id:
        raise refuse("model_id", model_id, "no training model named", "send the model_id create_model returned")
    check_loss_fn(loss_fn)
    if not data:
        raise refuse("data", [], "no datum to compute the loss on", "send at least one tinker.Datum")
    loss_fn_config: dict[str, float] = {}
    for key, value in config.items():
        if isinstance(value, str) or not math.isfinite(float(value)):
            raise refuse(
                f"loss_fn_config.{key}", value, f"the {loss_fn} loss takes finite numbers only", "pass a number"
            )
        loss_fn_config[key] = float(value)
    return ForwardBackwardCall(model_id, seq_id, data, loss_fn, loss_fn_config or None, forward_only)


def check_loss_fn(loss_fn: str) -> None:
    if loss_fn not in LOSS_FUNCTIONS:
        raise refuse(
            "loss_fn",
            loss_fn,
            f"forge-rl serve computes {', '.join(LOSS_FUNCTIONS)} only",
            "pass one of them (a custom loss runs client-side through forward_backward_custom)",
        )


def _datum_from_proto(msg: pb.Datum, field: str, max_context_length: int) -> TrainingDatum:
    tokens: list[int] = []
    for i, chunk in enumerate(msg.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise _non_text_chunk(f"{field}.model_input.chunks[{i}]", kind)
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise refuse(
                f"{field}.model_input.chunks[{i}].tokens",
                f"{len(raw)} bytes",
                "not whole int32 ids",
                "send the tokens as the SDK packs them",
            )
        tokens.extend(np.frombuffer(raw, dtype=np.int32).tolist())
    tokens = _checked_tokens(tokens, f"{field}.model_input", max_context_length)
    inputs = {name: _tensor_from_proto(t, f"{field}.loss_fn_inputs.{name}") for name, t in msg.loss_fn_inputs.items()}
    return _datum(tokens, inputs, field)


def _tensor_from_proto(msg: pb.Tensor, field: str) -> np.ndarray:
    np_dtype = _PROTO_DTYPES.get(msg.dtype)
    if np_dtype is None:
        raise refuse(
            f"{field}.dtype",
            pb.DType.Name(msg.dtype) if msg.dtype in pb.DType.values() else msg.dtype,
            "loss inputs are float32 or int64",
            "send float32 or int64",
        )
    dtype = "int64" if np_dtype.kind == "i" else "float32"
    shape = list(msg.shape) or None
    if msg.WhichOneof("encoding") == "sparse_csr":
        csr = msg.sparse_csr
        values = _frombuffer(csr.values, np_dtype, f"{field}.sparse_csr.values")
        crow = _frombuffer(csr.crow_indices, np.dtype(np.int64), f"{field}.sparse_csr.crow_indices").tolist()
        col = _frombuffer(csr.col_indices, np.dtype(np.int64), f"{field}.sparse_csr.col_indices").tolist()
        return _dense(values, dtype, shape, crow, col, field)
    return _dense(_frombuffer(msg.dense, np_dtype, f"{field}.dense"), dtype, shape, None, None, field)


def _frombuffer(raw: bytes, dtype: np.dtype, field: str) -> np.ndarray:
    if len(raw) % dtype.itemsize:
        raise refuse(field, f"{len(raw)} bytes", f"not whole {dtype} values", "send the tensor as the SDK packs it")
    return np.frombuffer(raw, dtype=dtype)


def _dense(
    values: np.ndarray,
    dtype: str,
    shape: Sequence[int] | None,
    crow: Sequence[int] | None,
    col: Sequence[int] | None,
    field: str,
) -> np.ndarray:
    """A loss input as a dense array of its wire dtype: CSR layouts filled in (absent cells 0, the
    SDK's default pad), a flat list shaped by `shape`."""
    np_dtype: np.dtype[Any] = np.dtype(np.int64) if dtype == "int64" else np.dtype(np.float32)
    if values.dtype.kind == "f" and np_dtype.kind == "i":
        if not np.all(np.equal(np.mod(values, 1), 0)):
            raise refuse(
                f"{field}.data", values[:8].tolist(), "token ids must be whole numbers", "send int64 token ids"
            )
    values = values.astype(np_dtype, copy=False)
    if crow is not None or col is not None:
        if crow is None or col is None or shape is None or len(shape) != 2:
            raise refuse(
                field,
                {"shape": shape},
                "a sparse CSR tensor needs crow and col indices and a 2-D shape",
                "send both index lists and the dense shape",
            )
        rows, cols = int(shape[0]), int(shape[1])
        if len(crow) != rows + 1 or len(col) != len(values) or (crow and (crow[0] != 0 or crow[-1] != len(values))):
            raise refuse(
                f"{field}.sparse_crow_indices",
                list(crow)[:8],
                "the CSR indices do not match the values and shape",
                "send the indices TensorData.from_torch_sparse writes",
            )
        if col and (min(col) < 0 or max(col) >= cols):
            raise refuse(
                f"{field}.sparse_col_indices",
                list(col)[:8],
                f"a column index lies outside 0..{cols - 1}",
                "send column indices inside the shape",
            )
        dense = np.zeros((rows, cols), dtype=np_dtype)
        row_of: np.ndarray = np.repeat(np.arange(rows), np.diff(np.asarray(crow, dtype=np.int64)))
        dense[row_of, np.asarray(col, dtype=np.int64)] = values
        return dense
    if shape is not None:
        if any(s < 0 for s in shape) or math.prod(shape) != values.size:
            raise refuse(
                f"{field}.shape",
                list(shape),
                f"does not hold the {values.size} values sent",
                "send the shape of the data",
            )
        return values.reshape(tuple(shape))
    return values


def _datum(tokens: list[int], inputs: dict[str, np.ndarray], field: str) -> TrainingDatum:
    if "target_tokens" not in inputs:
        raise refuse(
            f"{field}.loss_fn_inputs",
            sorted(inputs),
            "every loss reads target_tokens",
            "add loss_fn_inputs['target_tokens'], one id per input token",
        )
    checked: dict[str, np.ndarray] = {}
    for name, array in inputs.items():
        where = f"{field}.loss_fn_inputs.{name}"
        if array.ndim == 0 or array.shape[0] != len(tokens):
            raise refuse(
                where,
                f"shape {list(array.shape)}",
                f"the model input has {len(tokens)} tokens and loss inputs give one row per token",
                f"send {len(tokens)} rows",
            )
        if name in _INT_INPUTS:
            if array.dtype.kind != "i":
                raise refuse(f"{where}.dtype", str(array.dtype), "target_tokens holds token ids", "send it as int64")
            if array.size and array.min() < 0:
                raise refuse(
                    where, int(array.min()), "token ids are never negative", "send the tokenizer's ids (0 or more)"
                )
            checked[name] = array.astype(np.int64, copy=False)
        else:
            as_float: np.ndarray = array.astype(np.float32, copy=False)
            if not np.all(np.isfinite(as_float)):
                raise refuse(where, "a NaN or infinite value", "loss inputs are finite numbers", "send finite values")
            checked[name] = as_float
    return TrainingDatum(tokens=tokens, inputs=checked)


# --- forward_backward results -------------------------------------------------------------------

LOSS_FN_OUTPUT_TYPE = "ArrayRecord"


def _checked_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """The metrics as the SDK folds them over a request's chunks: every name ends in one
    ":<reduction>" (the SDK splits on it), so a name without one is a backend bug named here."""
    for name in metrics:
        if name.count(":") != 1:
            raise ValueError(
                f"the backend's metric {name!r} is not 'name:reduction' (e.g. 'loss:sum'), which the tinker SDK requires to combine chunks"
            )
    return {name: float(value) for name, value in metrics.items()}


def _checked_outputs(result: ForwardBackwardResult, num_data: int) -> tuple[list[str], list[dict[str, np.ndarray]]]:
    if len(result.outputs) != num_data:
        raise ValueError(
            f"the backend returned {len(result.outputs)} outputs for {num_data} data; it must return one per datum"
        )
    names = sorted(result.outputs[0]) if result.outputs else []
    outputs = []
    for i, out in enumerate(result.outputs):
        if sorted(out) != names:
            raise ValueError(
                f"the backend's output {i} holds {sorted(out)}, output 0 holds {names}; every datum's output must hold the same fields"
            )
        outputs.append({name: _output_array(np.asarray(out[name])) for name in names})
    return names, outputs


def _output_array(array: np.ndarray) -> np.ndarray:
    array = np.atleast_1d(array)
    return np.ascontiguousarray(array, dtype=np.int64 if array.dtype.kind in "iub" else np.float32)


def forward_backward_output_proto(result: ForwardBackwardResult, num_data: int) -> bytes:
    """The protobuf ForwardBackwardOutput `tinker.proto.response_conv` reads: one ArrayRecord whose
    fields batch every datum's arrays (data concatenated, byte offsets beside)."""
    names, outputs = _checked_outputs(result, num_data)
    msg = pb.ForwardBackwardOutput(loss_fn_output_type=LOSS_FN_OUTPUT_TYPE, metrics=_checked_metrics(result.metrics))
    record = msg.loss_fn_outputs.add()
    record.type_tag = LOSS_FN_OUTPUT_TYPE
    record.num_datums = len(outputs)
    for name in names:
        arrays = [out[name] for out in outputs]
        trailing = arrays[0].shape[1:]
        if any(a.shape[1:] != trailing for a in arrays):
            raise ValueError(
                f"the backend's {name!r} outputs differ in trailing shape; each datum's must be [T, *{list(trailing)}]"
            )
        batched = record.fields[name]
        batched.dtype = pb.DTYPE_INT64 if arrays[0].dtype.kind == "i" else pb.DTYPE_FLOAT32
        batched.trailing_shape.extend(trailing)
        batched.data = b"".join(a.tobytes() for a in arrays)
        batched.offsets = np.cumsum([0] + [a.nbytes for a in arrays], dtype=np.int64).tobytes()
    return msg.SerializeToString()


def forward_backward_output_json(result: ForwardBackwardResult, num_data: int) -> dict[str, Any]:
    """The JSON ForwardBackwardOutput, for a client that does not ask for protobuf."""
    names, outputs = _checked_outputs(result, num_data)
    return {
        "loss_fn_output_type": LOSS_FN_OUTPUT_TYPE,
        "loss_fn_outputs": [
            {
                name: {
                    "data": out[name].ravel().tolist(),
                    "dtype": "int64" if out[name].dtype.kind == "i" else "float32",
                    "shape": list(out[name].shape),
                }
                for name in names
            }
            for out in outputs
        ],
        "metrics": _checked_metrics(result.metrics),
    }


# --- sampling -----------------------------------------------------------------------------------

_UNSUPPORTED_SAMPLE_FIELDS = {"target_prompt_logprobs": None, "prompt_alt_tokens_k": 0}
"""SampleRequest fields the generators do not compute, with the value that asks for nothing."""

MAX_TOPK_LOGPROBS = 20
"""The widest top-k of logprobs a sample may ask for (the generators' vLLM max_logprobs is at least this)."""

_MASK_TOKEN, _MASK_LOGPROB = 0, -99999.0
"""What fills a TopkLogprobs row past its entries, and the whole of a position with none (the SDK's sentinel)."""


@dataclass(frozen=True)
class SampleCall:
    spec: SampleSpec
    prompt_logprobs_last_n: int | None
    """Score only the prompt's last N tokens: the face blanks the earlier ones."""


def sample_call(request: types.SampleRequest, max_context_length: int, max_num_samples: int) -> SampleCall:
    """A sample request in the backend's terms, refusing what the generators cannot honour."""
    for name, nothing in _UNSUPPORTED_SAMPLE_FIELDS.items():
        value = getattr(request, name)
        if value != nothing:
            raise refuse(name, value, "forge-rl serve's generators do not compute it", f"leave {name} at {nothing!r}")
    if request.record_stability_info:
        raise refuse(
            "record_stability_info",
            True,
            "forge-rl serve records no stability information (stable_reinforce is not served)",
            "leave it unset",
        )
    prompt = model_input_tokens(request.prompt, "prompt", max_context_length)
    if len(prompt) >= max_context_length:
        raise refuse(
            "prompt",
            f"{len(prompt)} tokens",
            f"fills the served model's {max_context_length}-token context: no room to sample",
            "shorten the prompt",
        )
    if not 1 <= request.num_samples <= max_num_samples:
        raise refuse(
            "num_samples",
            request.num_samples,
            f"must be between 1 and {max_num_samples}",
            "ask for 1 or more samples per request",
        )
    params = request.sampling_params
    room = max_context_length - len(prompt)
    if params.max_tokens is not None and not 1 <= params.max_tokens <= room:
        raise refuse(
            "sampling_params.max_tokens",
            params.max_tokens,
            f"must be between 1 and {room}: the {max_context_length}-token context holds the {len(prompt)}-token prompt and its continuation",
            "lower max_tokens or shorten the prompt",
        )
    if not (math.isfinite(params.temperature) and params.temperature >= 0):
        raise refuse(
            "sampling_params.temperature",
            params.temperature,
            "a temperature is 0 (greedy) or more",
            "pass e.g. temperature=1.0",
        )
    if not (0 < params.top_p <= 1):
        raise refuse("sampling_params.top_p", params.top_p, "top_p lies in (0, 1]", "pass e.g. top_p=1.0")
    if params.top_k == 0 or params.top_k < -1:
        raise refuse("sampling_params.top_k", params.top_k, "top_k is -1 (no limit) or 1 or more", "pass top_k=-1")
    for name in ("topk_prompt_logprobs", "topk_sample_logprobs"):
        k = getattr(request, name)
        if not 0 <= k <= MAX_TOPK_LOGPROBS:
            raise refuse(
                name,
                k,
                f"must be between 0 (none) and {MAX_TOPK_LOGPROBS}",
                f"ask for at most {MAX_TOPK_LOGPROBS} tokens per position",
            )
    stop = _stop(params.stop)
    last_n = request.prompt_logprobs_last_n
    if last_n is not None:
        if not request.prompt_logprobs:
            raise refuse(
                "prompt_logprobs_last_n",
                last_n,
                "applies to prompt logprobs",
                "set prompt_logprobs (include_prompt_logprobs=True)",
            )
        if not 1 <= last_n <= len(prompt) - 1:
            raise refuse(
                "prompt_logprobs_last_n",
                last_n,
                f"must be between 1 and {len(prompt) - 1} for a {len(prompt)}-token prompt",
                "pass a smaller N",
            )
    spec = SampleSpec(
        prompt=prompt,
        num_samples=request.num_samples,
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        stop=stop,
        seed=params.seed,
        prompt_logprobs=bool(request.prompt_logprobs),
        topk_prompt_logprobs=request.topk_prompt_logprobs,
        topk_sample_logprobs=request.topk_sample_logprobs,
    )
    return SampleCall(spec, last_n)


def _stop(stop: str | Sequence[str] | Sequence[int] | None) -> list[int] | list[str] | None:
    if stop is None:
        return None
    if isinstance(stop, str):
        return [stop]
    items: list[str | int] = list(stop)
    if all(isinstance(s, str) for s in items):
        return [str(s) for s in items]
    if all(isinstance(s, int) and not isinstance(s, bool) for s in items):
        bad = next((s for s in items if int(s) < 0), None)
        if bad is not None:
            raise refuse("sampling_params.stop", bad, "stop token ids are never negative", "send the tokenizer's ids")
        return [int(s) for s in items]
    raise refuse(
        "sampling_params.stop", items, "mixes token ids and strings", "send stop strings or stop token ids, not both"
    )


def _prompt_logprobs(result: SampleResult, call: SampleCall) -> np.ndarray | None:
    if not call.spec.prompt_logprobs:
        return None
    if result.prompt_logprobs is None or len(result.prompt_logprobs) != len(call.spec.prompt):
        got = None if result.prompt_logprobs is None else len(result.prompt_logprobs)
        raise ValueError(
            f"the backend returned {got} prompt logprobs for a {len(call.spec.prompt)}-token prompt; it must return one per prompt token"
        )
    logprobs = np.array([math.nan if lp is None else lp for lp in result.prompt_logprobs], dtype=np.float32)
    if call.prompt_logprobs_last_n is not None:
        logprobs[: len(logprobs) - call.prompt_logprobs_last_n] = math.nan
    return logprobs


def _topk_prompt_rows(result: SampleResult, call: SampleCall) -> list[TopK | None] | None:
    """The prompt's top-k rows, one per prompt token, the first and those before the last N
    (prompt_logprobs_last_n) None."""
    if not call.spec.topk_prompt_logprobs:
        return None
    rows = result.topk_prompt_logprobs
    if rows is None or len(rows) != len(call.spec.prompt):
        got = None if rows is None else len(rows)
        raise ValueError(
            f"the backend returned {got} top-k prompt rows for a {len(call.spec.prompt)}-token prompt; it must return one per prompt token"
        )
    rows = [row or None for row in rows]
    rows[0] = None
    if call.prompt_logprobs_last_n is not None:
        rows[: len(rows) - call.prompt_logprobs_last_n] = [None] * (len(rows) - call.prompt_logprobs_last_n)
    return rows


def _checked_topk(rows: Sequence[TopK | None], k: int, what: str) -> None:
    for i, row in enumerate(rows):
        if row is not None and len(row) > k:
            raise ValueError(f"the backend's {what} row {i} has {len(row)} entries for k={k}")


def _topk_proto(rows: Sequence[TopK | None], k: int, msg: pb.TopkLogprobs) -> None:
    """`rows` as the dense (length, k) matrices of the SDK's TopkLogprobs, sentinel-filled."""
    token_ids: np.ndarray = np.full((len(rows), k), _MASK_TOKEN, dtype=np.int32)
    logprobs: np.ndarray = np.full((len(rows), k), _MASK_LOGPROB, dtype=np.float32)
    for i, row in enumerate(rows):
        for j, (token, logprob) in enumerate(row or ()):
            token_ids[i, j], logprobs[i, j] = token, logprob
    msg.length, msg.k = len(rows), k
    msg.token_ids, msg.logprobs = token_ids.tobytes(), logprobs.tobytes()


def _topk_json(rows: Sequence[TopK | None] | None) -> list[list[list[float]] | None] | None:
    return None if rows is None else [None if row is None else [[int(t), float(lp)] for t, lp in row] for row in rows]


def _checked_sequences(result: SampleResult, call: SampleCall) -> None:
    if len(result.sequences) != call.spec.num_samples:
        raise ValueError(
            f"the backend returned {len(result.sequences)} sequences for num_samples={call.spec.num_samples}"
        )
    for i, seq in enumerate(result.sequences):
        if len(seq.logprobs) != len(seq.tokens):
            raise ValueError(
                f"the backend's sequence {i} has {len(seq.tokens)} tokens and {len(seq.logprobs)} logprobs; it must give one per token"
            )
        if seq.stop_reason not in ("stop", "length"):
            raise ValueError(
                f"the backend's sequence {i} stopped for {seq.stop_reason!r}; the Tinker API knows 'stop' and 'length'"
            )
        k = call.spec.topk_sample_logprobs
        if k:
            if seq.topk_logprobs is None or len(seq.topk_logprobs) != len(seq.tokens):
                got = None if seq.topk_logprobs is None else len(seq.topk_logprobs)
                raise ValueError(
                    f"the backend's sequence {i} has {len(seq.tokens)} tokens and {got} top-k rows; it must give one per token"
                )
            _checked_topk(seq.topk_logprobs, k, f"sequence {i}'s top-k")


def sample_response_proto(result: SampleResult, call: SampleCall) -> bytes:
    """The protobuf SampleResponse `tinker.proto.response_conv` reads."""
    _checked_sequences(result, call)
    msg = pb.SampleResponse()
    for seq in result.sequences:
        out = msg.sequences.add()
        out.stop_reason = pb.STOP_REASON_STOP if seq.stop_reason == "stop" else pb.STOP_REASON_LENGTH
        out.tokens = np.asarray(seq.tokens, dtype=np.int32).tobytes()
        out.logprobs = np.asarray(seq.logprobs, dtype=np.float32).tobytes()
        if call.spec.topk_sample_logprobs:
            assert seq.topk_logprobs is not None  # _checked_sequences refuses a sequence without its rows
            _topk_proto(seq.topk_logprobs, call.spec.topk_sample_logprobs, out.topk_sampled_logprobs)
    prompt_logprobs = _prompt_logprobs(result, call)
    if prompt_logprobs is not None:
        msg.prompt_logprobs = prompt_logprobs.tobytes()
    topk_prompt = _topk_prompt_rows(result, call)
    if topk_prompt is not None:
        _checked_topk(topk_prompt, call.spec.topk_prompt_logprobs, "top-k prompt")
        _topk_proto(topk_prompt, call.spec.topk_prompt_logprobs, msg.topk_prompt_logprobs)
    return msg.SerializeToString()


def sample_response_json(result: SampleResult, call: SampleCall) -> dict[str, Any]:
    """The JSON SampleResponse, for a client that does not ask for protobuf."""
    _checked_sequences(result, call)
    prompt_logprobs = _prompt_logprobs(result, call)
    topk_prompt = _topk_prompt_rows(result, call)
    if topk_prompt is not None:
        _checked_topk(topk_prompt, call.spec.topk_prompt_logprobs, "top-k prompt")
    return {
        "type": "sample",
        "sequences": [
            {
                "tokens": list(seq.tokens),
                "logprobs": [float(lp) for lp in seq.logprobs],
                "stop_reason": seq.stop_reason,
                "topk_logprobs": _topk_json(seq.topk_logprobs) if call.spec.topk_sample_logprobs else None,
            }
            for seq in result.sequences
        ],
        "prompt_logprobs": None
        if prompt_logprobs is None
        else [None if math.isnan(lp) else float(lp) for lp in prompt_logprobs.tolist()],
        "topk_prompt_logprobs": _topk_json(topk_prompt),
    }
