"""Keep Routing on vLLM's CPU backend: record the experts every generated token was sampled through.

vLLM's own capture (`enable_return_routed_experts`, vllm/model_executor/layers/fused_moe/
routed_experts_capturer.py with vllm/distributed/aux_output_connector/) is wired into the GPU
model runner (V2) only. On CPU the same per-layer hook exists: every MoE router
(`BaseRouter.capture_fn`, bound by vLLM's `bind_routed_experts_capturer`) hands its top-k expert
ids of each forward pass to a callback. `RoutingCaptureExtension`, mixed into the worker (engine
argument `worker_extension_cls`), binds that callback and keeps, per request, the routing of
the rows that sampled a token. forge_rl's CPU worker runs inside the engine-core process
(UniProcExecutor), so `collective_rpc` reaches it directly:

    forge_start_routing_capture()    bind the hooks (once, after start); returns (layers, top_k)
    forge_take_routing(request_id)   the records of a finished request's completions, by child
                                     index, removed from the worker

Which rows. A forward step computes rows of several requests, in the order of the model runner's
`input_batch.req_ids`, `num_scheduled_tokens[req]` consecutive rows each, at the positions the
model is called with. Row at position p of a request with a prompt of P tokens sampled generated
token p - (P - 1) when p >= P - 1 (`forge_rl.routing`: a token's routing is that of the pass that
sampled it). The first row recorded for a token is kept: a later recomputation of the same
position (preemption, a KV recompute after a weight swap) did not sample it.

`RoutingCapture` is that bookkeeping in plain Python (unit-tested without vLLM); the extension
only feeds it.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from forge_rl.engines.forward_clock import ForwardClockExtension
from forge_rl.engines.vllm_staging import StagedWeightsExtension
from forge_rl.routing import RoutingRecord, expert_id_dtype

_INTERNAL_ID = re.compile(r"^(?:(?P<child>\d+)_)?(?P<external>.+)-[0-9a-zA-Z]{8}$")
"""vLLM's internal request id: "<external>-<8 random chars>" (input_processor.assign_request_id),
prefixed "<child index>_" for each of n > 1 samples (parallel_sampling.ParentRequest)."""


class RoutingCapture:
    """Per request, per generated token, the [layers, top_k] experts of the row that sampled it."""

    def __init__(self, num_layers: int, top_k: int, num_experts: int):
        self.num_layers, self.top_k = num_layers, top_k
        self.dtype = expert_id_dtype(num_experts)
        self._tokens: dict[str, dict[int, torch.Tensor]] = {}

    def add_step(
        self,
        request_ids: list[str],
        num_rows: list[int],
        prompt_lengths: list[int],
        positions: torch.Tensor,
        layer_rows: list[torch.Tensor | None],
    ) -> None:
        """One forward step: rows of `request_ids` in order, `num_rows` each; `positions` [T] and
        `layer_rows[layer]` [T, top_k] (padding rows past sum(num_rows) ignored)."""
        if any(rows is None for rows in layer_rows):
            missing = [layer for layer, rows in enumerate(layer_rows) if rows is None]
            raise RuntimeError(f"routing capture: MoE layers {missing} reported no routing in this step")
        ids_TXK = torch.stack([rows[: sum(num_rows)] for rows in layer_rows if rows is not None], dim=1).to(self.dtype)
        positions = positions[: sum(num_rows)].tolist()
        start = 0
        for request_id, count, prompt_length in zip(request_ids, num_rows, prompt_lengths):
            tokens = self._tokens.setdefault(request_id, {})
            for row in range(start, start + count):
                generated = positions[row] - (prompt_length - 1)
                if generated >= 0 and generated not in tokens:
                    tokens[generated] = ids_TXK[row]
            start += count

    def take(self, external_id: str, num_tokens: dict[int, int]) -> dict[int, RoutingRecord]:
        """The records of request `external_id`'s completions (child index -> record of its first
        `num_tokens[index]` generated tokens), dropped from memory. A completion with a gap in its
        rows (which the hook should never leave) gets no record rather than a wrong one."""
        records = {}
        for internal_id in [i for i in self._tokens if (m := _INTERNAL_ID.match(i)) and m["external"] == external_id]:
            tokens = self._tokens.pop(internal_id)
            matched = _INTERNAL_ID.match(internal_id)
            assert matched is not None  # picked above by this pattern
            child = int(matched["child"] or 0)
            wanted = num_tokens.get(child, 0)
            if all(t in tokens for t in range(wanted)):
                ids = [tokens[t] for t in range(wanted)]
                records[child] = RoutingRecord(
                    torch.stack(ids) if ids else torch.empty((0, self.num_layers, self.top_k), dtype=self.dtype)
                )
        return records

    @property
    def num_requests(self) -> int:
        return len(self._tokens)


class RoutingCaptureExtension:
    """The worker side (see the module docstring); vLLM is imported only where it runs."""

    model_runner: Any
    """vLLM's worker's, which this class is mixed into."""

    def forge_start_routing_capture(self) -> tuple[int, int]:
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import bind_routed_experts_capturer

        runner = self.model_runner
        model = runner.get_model()
        model_config = runner.vllm_config.model_config
        capture = RoutingCapture(
            model_config.get_total_num_hidden_layers(),
            model_config.get_num_experts_per_tok(),
            model_config.get_num_experts(),
        )
        step: dict[str, Any] = {"positions": None, "rows": [None] * capture.num_layers}

        class _Sink:  # what bind_routed_experts_capturer calls: capture(layer_id, topk_ids)
            @staticmethod
            def capture(layer_id: int, topk_ids: torch.Tensor) -> None:
                step["rows"][layer_id] = topk_ids.detach().to("cpu", copy=True)

        bind_routed_experts_capturer(model, _Sink())
        forward = model.forward

        def forward_recording_positions(*args, **kwargs):
            step["positions"] = kwargs["positions"] if "positions" in kwargs else args[1]
            return forward(*args, **kwargs)

        model.forward = forward_recording_positions
        execute_model = runner.execute_model

        def execute_model_capturing(scheduler_output, *args, **kwargs):
            step["positions"], step["rows"] = None, [None] * capture.num_layers
            output = execute_model(scheduler_output, *args, **kwargs)
            if step["positions"] is not None:
                request_ids = list(runner.input_batch.req_ids)
                capture.add_step(
                    request_ids,
                    [scheduler_output.num_scheduled_tokens[r] for r in request_ids],
                    [runner.requests[r].num_prompt_tokens for r in request_ids],
                    step["positions"].to("cpu"),
                    step["rows"],
                )
            return output

        runner.execute_model = execute_model_capturing
        self._forge_routing_capture = capture
        return capture.num_layers, capture.top_k

    def forge_take_routing(self, external_id: str, num_tokens: dict[int, int]) -> dict[int, dict]:
        """Records as `RoutingRecord.to_dict` (plain data across the RPC)."""
        records = self._forge_routing_capture.take(external_id, num_tokens)
        return {child: record.to_dict() for child, record in records.items()}


class ForgeWorkerExtension(StagedWeightsExtension, RoutingCaptureExtension, ForwardClockExtension):
    """Everything forge_rl adds to vLLM's worker (one `worker_extension_cls`)."""
