"""forge_rl.service.wire against the tinker SDK's own converters: what the SDK writes, the face reads
back unchanged; what the face writes, the SDK reads back unchanged."""

from __future__ import annotations

import math

import numpy as np
import pytest
import zstandard

tinker = pytest.importorskip("tinker")

from tinker import types
from tinker.lib.chunked_fwdbwd_helpers import combine_fwd_bwd_output_results
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_proto_response

from forge_rl.service import wire
from forge_rl.service.backend import ForwardBackwardResult, SampledSequence, SampleResult

CONTEXT = 64


def datum(tokens: list[int], **inputs) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


def through_proto(request: types.ForwardBackwardRequest, forward_only: bool = False) -> wire.ForwardBackwardCall:
    msg = forward_backward_request_to_proto(request)
    msg.forward_only = forward_only
    read = wire.read_forward_backward_proto(msg.SerializeToString())
    return wire.forward_backward_from_proto(read, CONTEXT)


def fb_request(data: list[types.Datum], loss_fn: str = "cross_entropy", config=None) -> types.ForwardBackwardRequest:
    return types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config),
        model_id="m-1",
        seq_id=3,
    )


def test_a_forward_backward_request_the_sdk_writes_reads_back_as_the_same_tokens_and_inputs():
    data = [
        datum([1, 2, 3], target_tokens=[2, 3, 4], weights=np.array([0.0, 1.0, 1.0], dtype=np.float32)),
        datum(
            [5, 6],
            target_tokens=[6, 7],
            logprobs=[-0.25, -1.5],
            advantages=np.array([0.5, -0.5], dtype=np.float32),
            weights=[1.0, 1.0],
        ),
    ]
    call = through_proto(fb_request(data, "importance_sampling", {"clip_low": 0.8}), forward_only=True)
    assert (call.model_id, call.seq_id, call.loss_fn, call.forward_only) == ("m-1", 3, "importance_sampling", True)
    assert call.loss_fn_config == {"clip_low": 0.8}
    assert [d.tokens for d in call.data] == [[1, 2, 3], [5, 6]]
    first, second = call.data
    assert first.inputs["target_tokens"].dtype == np.int64 and first.inputs["target_tokens"].tolist() == [2, 3, 4]
    assert first.inputs["weights"].dtype == np.float32 and first.inputs["weights"].tolist() == [0.0, 1.0, 1.0]
    assert second.inputs["logprobs"].tolist() == [-0.25, -1.5]
    assert second.inputs["advantages"].tolist() == [0.5, -0.5]


def test_the_json_form_of_the_request_reads_back_the_same_as_the_protobuf():
    data = [datum([1, 2, 3], target_tokens=[2, 3, 4], weights=[1.0, 0.5, 0.0])]
    body = {
        "forward_input": {
            "data": [
                {
                    "model_input": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
                    "loss_fn_inputs": {
                        "target_tokens": {"data": [2, 3, 4], "dtype": "int64"},
                        "weights": {"data": [1.0, 0.5, 0.0], "dtype": "float32"},
                    },
                }
            ],
            "loss_fn": "cross_entropy",
        },
        "model_id": "m-1",
        "seq_id": 3,
    }
    import json

    from_json = wire.forward_backward_from_json(
        wire.read_forward_backward_json(json.dumps(body).encode()), CONTEXT, forward_only=True
    )
    from_proto = through_proto(fb_request(data), forward_only=True)
    assert from_json.forward_only and from_json.data[0].tokens == from_proto.data[0].tokens
    for name in ("target_tokens", "weights"):
        np.testing.assert_array_equal(from_json.data[0].inputs[name], from_proto.data[0].inputs[name])


def test_a_sparse_loss_input_reads_back_dense_with_zeros_where_the_sdk_left_cells_out():
    # A [3, 2] target_tokens with two cells set, as TensorData.from_torch_sparse would send it.
    sparse = types.TensorData(
        data=[7, 9], dtype="int64", shape=[3, 2], sparse_crow_indices=[0, 1, 1, 2], sparse_col_indices=[1, 0]
    )
    call = through_proto(fb_request([datum([1, 2, 3], target_tokens=sparse)]))
    assert call.data[0].inputs["target_tokens"].tolist() == [[0, 7], [0, 0], [9, 0]]


def test_a_zstd_body_as_the_sdk_compresses_it_inflates_back_and_a_bomb_past_the_limit_is_413():
    body = forward_backward_request_to_proto(fb_request([datum([1, 2], target_tokens=[2, 3])])).SerializeToString()
    assert wire.decompress(zstandard.ZstdCompressor().compress(body), "zstd", 1 << 20) == body
    with pytest.raises(wire.FieldRefused) as refused:
        wire.decompress(zstandard.ZstdCompressor().compress(b"\0" * 10_000), "zstd", 1000)
    assert refused.value.status == 413


@pytest.mark.parametrize(
    "data, loss_fn, field, words",
    [
        (
            [datum([1, -2, 3], target_tokens=[1, 1, 1])],
            "cross_entropy",
            "data[0].model_input.tokens[1]",
            "never negative",
        ),
        ([datum([1, 2, 3], target_tokens=[1, 1])], "cross_entropy", "data[0].loss_fn_inputs.target_tokens", "3 tokens"),
        ([datum([1, 2], weights=[1.0, 1.0])], "cross_entropy", "data[0].loss_fn_inputs", "target_tokens"),
        (
            [datum([1, 2], target_tokens=[1, 1])],
            "gspo",
            "loss_fn",
            "cross_entropy, importance_sampling, ppo, cispo, dro",
        ),
        (
            [datum(list(range(CONTEXT + 1)), target_tokens=list(range(CONTEXT + 1)))],
            "cross_entropy",
            "data[0].model_input",
            f"context of {CONTEXT}",
        ),
        ([], "cross_entropy", "data", "at least one"),
    ],
)
def test_a_malformed_forward_backward_is_refused_naming_the_field(data, loss_fn, field, words):
    with pytest.raises(wire.FieldRefused) as refused:
        through_proto(fb_request(data, loss_fn))
    assert refused.value.field == field and field in str(refused.value) and words in str(refused.value)


def test_an_image_chunk_is_refused_as_text_only():
    image = types.Datum(
        model_input=types.ModelInput(
            chunks=[
                types.EncodedTextChunk(tokens=[1]),
                types.ImageChunk(data=b"\x89PNG", format="png", expected_tokens=4),
            ]
        ),
        loss_fn_inputs={"target_tokens": [1, 1, 1, 1, 1]},
    )
    with pytest.raises(wire.FieldRefused) as refused:
        through_proto(fb_request([image]))
    assert refused.value.field == "data[0].model_input.chunks[1]" and "EncodedTextChunk" in str(refused.value)


def test_a_body_that_is_not_the_protobuf_is_refused():
    with pytest.raises(wire.FieldRefused) as refused:
        wire.read_forward_backward_proto(b"\xff\xff\xff not a message")
    assert refused.value.field == "body"


def test_the_forward_backward_output_reads_back_in_the_sdk_with_the_same_arrays_and_metrics():
    outputs = [
        {
            "logprobs": np.array([-0.5, -0.5, -0.5], dtype=np.float32),
            "elementwise_loss": np.array([0.0, 0.5, 0.5], dtype=np.float32),
        },
        {"logprobs": np.array([-0.5], dtype=np.float32), "elementwise_loss": np.array([0.5], dtype=np.float32)},
    ]
    result = ForwardBackwardResult(outputs=outputs, metrics={"loss:sum": 1.5})
    got = deserialize_proto_response(wire.forward_backward_output_proto(result, 2), types.ForwardBackwardOutput)
    assert got.metrics == {"loss:sum": 1.5}
    assert [out["logprobs"].tolist() for out in got.loss_fn_outputs] == [[-0.5, -0.5, -0.5], [-0.5]]
    assert got.loss_fn_outputs[0]["elementwise_loss"].shape == [3]
    # The SDK folds a request's chunks with the metric names' reductions.
    assert combine_fwd_bwd_output_results([got, got]).metrics == {"loss:sum": 3.0}
    assert wire.forward_backward_output_json(result, 2)["loss_fn_outputs"][1]["logprobs"] == {
        "data": [-0.5],
        "dtype": "float32",
        "shape": [1],
    }


def test_a_backend_result_the_sdk_could_not_fold_is_a_server_error_naming_it():
    with pytest.raises(ValueError, match="'loss'.*name:reduction"):
        wire.forward_backward_output_proto(
            ForwardBackwardResult(outputs=[{"logprobs": np.zeros(1)}], metrics={"loss": 1.0}), 1
        )
    with pytest.raises(ValueError, match="1 outputs for 2 data"):
        wire.forward_backward_output_proto(ForwardBackwardResult(outputs=[{"logprobs": np.zeros(1)}]), 2)


def sdk_sample_request(**fields) -> types.SampleRequest:
    request = types.SampleRequest(
        prompt=types.ModelInput.from_ints([4, 5, 6]),
        sampling_params=types.SamplingParams(max_tokens=4, stop="\n", seed=7),
        **fields,
    )
    # What the server reads: the JSON the SDK's resource dumps.
    return types.SampleRequest.model_validate(request.model_dump(mode="json", exclude_none=True))


def test_a_sample_request_reads_as_the_backend_spec():
    call = wire.sample_call(sdk_sample_request(num_samples=2, prompt_logprobs=True), CONTEXT, 8)
    spec = call.spec
    assert (spec.prompt, spec.num_samples, spec.max_tokens, spec.stop, spec.seed, spec.prompt_logprobs) == (
        [4, 5, 6],
        2,
        4,
        ["\n"],
        7,
        True,
    )


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"num_samples": 0}, "num_samples"),
        ({"topk_sample_logprobs": wire.MAX_TOPK_LOGPROBS + 1}, "topk_sample_logprobs"),
        ({"topk_prompt_logprobs": -1}, "topk_prompt_logprobs"),
        ({"prompt_alt_tokens_k": 2}, "prompt_alt_tokens_k"),
    ],
)
def test_a_sample_request_asking_what_the_generators_do_not_do_is_refused_naming_the_field(fields, field):
    with pytest.raises(wire.FieldRefused) as refused:
        wire.sample_call(sdk_sample_request(**fields), CONTEXT, 8)
    assert refused.value.field == field


def test_a_prompt_that_fills_the_context_is_refused_naming_it():
    with pytest.raises(wire.FieldRefused, match="no room to sample") as refused:
        wire.sample_call(sdk_sample_request(), 3, 8)  # the prompt's 3 tokens are the whole context
    assert refused.value.field == "prompt"


def test_the_sample_response_reads_back_in_the_sdk_with_the_same_tokens_logprobs_and_prompt_logprobs():
    call = wire.sample_call(sdk_sample_request(num_samples=2, prompt_logprobs=True), CONTEXT, 8)
    result = SampleResult(
        sequences=[
            SampledSequence(
                tokens=[6, 5, 4], logprobs=[-0.5, -0.25, -1.0], stop_reason="length", policy_versions=[1, 1, 1]
            ),
            SampledSequence(tokens=[9], logprobs=[-2.0], stop_reason="stop", policy_versions=[1]),
        ],
        prompt_logprobs=[None, -0.5, -0.75],
    )
    got = deserialize_proto_response(wire.sample_response_proto(result, call), types.SampleResponse)
    assert [s.tokens for s in got.sequences] == [[6, 5, 4], [9]]
    assert [s.logprobs for s in got.sequences] == [[-0.5, -0.25, -1.0], [-2.0]]
    assert [s.stop_reason for s in got.sequences] == ["length", "stop"]
    assert got.prompt_logprobs == [None, -0.5, -0.75]
    assert wire.sample_response_json(result, call)["prompt_logprobs"] == [None, -0.5, -0.75]


def test_prompt_logprobs_last_n_blanks_the_earlier_prompt_positions():
    call = wire.sample_call(sdk_sample_request(prompt_logprobs=True, prompt_logprobs_last_n=1), CONTEXT, 8)
    result = SampleResult(sequences=[SampledSequence([1], [-0.5], "length", [0])], prompt_logprobs=[None, -0.5, -0.75])
    got = deserialize_proto_response(wire.sample_response_proto(result, call), types.SampleResponse)
    assert got.prompt_logprobs[:2] == [None, None] and math.isclose(got.prompt_logprobs[2], -0.75)


def test_top_k_logprobs_read_back_in_the_sdk_as_it_lists_them_shorter_rows_and_blank_positions_included():
    call = wire.sample_call(
        sdk_sample_request(
            topk_prompt_logprobs=2, topk_sample_logprobs=2, prompt_logprobs=True, prompt_logprobs_last_n=1
        ),
        CONTEXT,
        8,
    )
    assert (call.spec.topk_prompt_logprobs, call.spec.topk_sample_logprobs) == (2, 2)
    sampled_topk = [[(6, -0.5), (7, -1.5)], [(5, -0.25)]]  # the second position's kept set held one token
    result = SampleResult(
        sequences=[SampledSequence([6, 5], [-0.5, -0.25], "length", [0, 0], sampled_topk)],
        prompt_logprobs=[None, -0.5, -0.75],
        topk_prompt_logprobs=[None, [(5, -0.5), (1, -2.0)], [(6, -0.75), (2, -1.0)]],
    )
    got = deserialize_proto_response(wire.sample_response_proto(result, call), types.SampleResponse)
    assert got.sequences[0].topk_logprobs == sampled_topk
    # Position 1 comes before the last one, so prompt_logprobs_last_n=1 blanks it as the SDK says.
    assert got.topk_prompt_logprobs == [None, None, [(6, -0.75), (2, -1.0)]]
    as_json = wire.sample_response_json(result, call)
    assert as_json["topk_prompt_logprobs"] == [None, None, [[6, -0.75], [2, -1.0]]]
    assert as_json["sequences"][0]["topk_logprobs"] == [[[6, -0.5], [7, -1.5]], [[5, -0.25]]]


def test_a_backend_top_k_result_of_the_wrong_shape_is_a_server_error_naming_it():
    call = wire.sample_call(sdk_sample_request(topk_sample_logprobs=1), CONTEXT, 8)
    missing = SampleResult(sequences=[SampledSequence([6, 5], [-0.5, -0.25], "length", [0, 0], [[(6, -0.5)]])])
    with pytest.raises(ValueError, match="2 tokens and 1 top-k rows"):
        wire.sample_response_proto(missing, call)
    too_wide = SampleResult(sequences=[SampledSequence([6], [-0.5], "length", [0], [[(6, -0.5), (7, -1.0)]])])
    with pytest.raises(ValueError, match="row 0 has 2 entries for k=1"):
        wire.sample_response_proto(too_wide, call)


def test_bad_json_and_a_field_of_the_wrong_type_are_refused_naming_the_field():
    with pytest.raises(wire.FieldRefused, match="not valid JSON"):
        wire.parse_json(types.OptimStepRequest, b"{not json")
    with pytest.raises(wire.FieldRefused) as refused:
        wire.parse_json(types.CreateModelRequest, b'{"session_id": "s", "model_seq_id": "first", "base_model": "b"}')
    assert refused.value.field == "model_seq_id" and "'first'" in str(refused.value)


def test_a_create_model_for_another_base_or_without_lora_is_refused():
    def create(**fields):
        return types.CreateModelRequest(session_id="s", model_seq_id=0, **fields)

    assert wire.lora_spec(create(base_model="base", lora_config=types.LoraConfig(rank=8, seed=3)), "base").rank == 8
    with pytest.raises(wire.FieldRefused, match="serves 'base' only"):
        wire.lora_spec(create(base_model="other", lora_config=types.LoraConfig(rank=8)), "base")
    with pytest.raises(wire.FieldRefused, match="LoRA adapters only"):
        wire.lora_spec(create(base_model="base"), "base")
