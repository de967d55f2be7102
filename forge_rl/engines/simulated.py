"""A SIMULATED generator engine and trainer step, for testing the control plane at scale.

Nothing here runs a model. `SimulatedEngine` stands behind the same interface as `VLLMEngine`
(`start`, `generate`, `swap_weights`, `policy_version`, `shutdown`, ...) and behaves like one
vLLM engine seen from outside: it admits requests up to `max_num_seqs`, prefills them, decodes the
whole batch one step at a time on a latency model calibrated to a GPU (`LatencyModel`), draws each
completion's length from a heavy-tailed distribution, stamps every token with the policy version
it was "decoded" under, and swaps weights between two decode steps (the keep-mode stall included).
Its tokens are placeholders (`PLACEHOLDER_TOKEN_ID`, logprob `PLACEHOLDER_LOGPROB`): nothing
downstream can learn from them. `SimTrainerConfig` is the matching trainer step: a wait computed
from the tokens in the batch (`forge_rl.actors.simulated_trainer`).

It is selected only by `generator.engine: sim` with `trainer.engine: sim` (configs/sim_*.yaml),
never by default, and never stands in for vLLM in the demo, the recipes or the integration tests
of the real path; a run that uses it says so in its summary (`simulated: true`).

Why it costs almost no CPU: the engine does not wake per token. Between two events (a request
arrives, a sequence finishes, a swap is asked for) the batch is constant, so the time of the next
k decode steps has a closed form (`LatencyModel.decode_s`); the engine sleeps until the first
sequence would finish and, when woken early, counts the whole steps that elapsed
(`LatencyModel.steps_within`), lets the step in progress finish (as a real engine would) and
re-plans. Per-token versions are kept as (version, count) spans and expanded once, when a
completion is returned.

Each engine stands for a GPU of its own, which decodes whether or not the host process that
drives it gets a core on time: the engine keeps the time its simulated GPU finishes its work in
hand (`_gpu_free_at`) and starts the next work there, not when its process next runs. On a
machine whose cores are all busy, a timer that fires late then costs no decode steps; the engine
catches up at once (the steps in between have a closed form) and hands its completions over as
soon as its process runs, so the delivery stays late by what the host costs, which is what the
control-plane benchmarks measure. (A step timed from the late wake-up would let a busy host slow
the simulated GPUs themselves.)

Time is the event loop's (`loop.time()`, `asyncio.sleep`), so tests drive it on a virtual clock
(tests/unit/engines/test_simulated_engine.py) and the results do not depend on how busy the machine is.

Calibration (docs/benchmarks/README.md, "scale"): Qwen3-8B in bf16 served by vLLM on one
H100 SXM (80 GB HBM3, 3.35 TB/s, 989 dense bf16 TFLOP/s). Decode is bound by memory traffic: every
step reads the 16.4 GB of weights (4.9 ms at peak bandwidth) plus the KV cache of every sequence in
the batch (36 layers x 8 KV heads x 128 dims x 2 (K and V) x 2 bytes = 144 KiB per context token,
44 ns per token at peak); compute adds 2 x 8.2 GFLOP per sequence per step. Prefill is bound by
compute: 16.4 GFLOP per prompt token. Against published figures: GPUStack's performance lab reports
vLLM (no tuning) serving Qwen3-8B on an H100 at 1.66 s per ShareGPT request at batch 1
(docs.gpustack.ai, performance-lab/qwen3-8b/h100-latency), about 6.5-7 ms per output token for
ShareGPT's ~250-token answers: the fixed 6.5 ms per step below.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from forge_rl.engines.engine import EngineCannot
from forge_rl.envs.runner import ContextExhausted, SampledTurn
from forge_rl.types import Completion, CompletionStatus, SampleResult, SampleSpec

_NEEDS_A_MODEL = "{what} needs a model: set --generator.engine vllm (the simulated engine has none)."

PLACEHOLDER_TOKEN_ID = 0
"""Every simulated token's id (an EOS is `eos_id` instead): a placeholder, not a sample of anything."""
PLACEHOLDER_LOGPROB = -1.0
"""Every simulated token's behaviour logprob: a placeholder."""


@dataclass(frozen=True)
class LatencyModel:
    """Seconds a GPU engine spends per decode step and per prefilled token (simulated time).

    decode step of a batch of B sequences holding C context tokens in all:
        step_s(B, C) = decode_step_fixed_s + B x decode_step_per_sequence_s + C x decode_step_per_context_token_s
    Defaults: Qwen3-8B bf16 on one H100 SXM with vLLM (module docstring for the derivation).
    """

    decode_step_fixed_s: float = 6.5e-3
    """Per step whatever the batch: reading the weights (16.4 GB at 3.35 TB/s = 4.9 ms) plus
    scheduling and kernel launches; matches GPUStack's published 6.5-7 ms per token at batch 1 (module docstring)."""
    decode_step_per_sequence_s: float = 3.0e-5
    """Per sequence in the batch: 2 x 8.2 GFLOP at about 55% of the H100's dense bf16 peak."""
    decode_step_per_context_token_s: float = 6.0e-8
    """Per context token of every sequence in the batch: its 144 KiB of KV read at about 75% of
    peak bandwidth."""
    prefill_per_token_s: float = 3.0e-5
    """Per prompt token prefilled: 16.4 GFLOP at about 55% of peak (about 33k tokens/s)."""

    def __post_init__(self) -> None:
        for name in (
            "decode_step_fixed_s",
            "decode_step_per_sequence_s",
            "decode_step_per_context_token_s",
            "prefill_per_token_s",
        ):
            value = getattr(self, name)
            if not 0.0 <= value < math.inf:
                raise ValueError(
                    f"generator.sim.latency.{name} ({value}) must be >= 0 and finite. "
                    f"Set --generator.sim.latency.{name.replace('_', '-')}."
                )

    def step_s(self, batch_size: int, context_tokens: int) -> float:
        """One decode step of `batch_size` sequences holding `context_tokens` tokens in all."""
        return (
            self.decode_step_fixed_s
            + batch_size * self.decode_step_per_sequence_s
            + context_tokens * self.decode_step_per_context_token_s
        )

    def decode_s(self, batch_size: int, context_tokens: int, num_steps: int) -> float:
        """`num_steps` decode steps of a constant batch whose context grows by `batch_size` tokens
        per step: sum over j < k of step_s(B, C + j B) = k step_s(B, C) + per_context B k (k-1) / 2."""
        k = num_steps
        return k * self.step_s(batch_size, context_tokens) + (
            self.decode_step_per_context_token_s * batch_size * k * (k - 1) / 2
        )

    def steps_within(self, batch_size: int, context_tokens: int, seconds: float) -> int:
        """Most whole decode steps that fit in `seconds` (the inverse of `decode_s`)."""
        a = self.decode_step_per_context_token_s * batch_size / 2  # decode_s(k) = a k^2 + b k
        b = self.step_s(batch_size, context_tokens) - a
        if seconds <= 0 or b + a <= 0:
            return 0
        k = seconds / b if a == 0 else (-b + math.sqrt(b * b + 4 * a * seconds)) / (2 * a)
        k = math.floor(k)
        while k > 0 and self.decode_s(batch_size, context_tokens, k) > seconds:  # float rounding
            k -= 1
        while self.decode_s(batch_size, context_tokens, k + 1) <= seconds:
            k += 1
        return k

    def prefill_s(self, num_tokens: int) -> float:
        return num_tokens * self.prefill_per_token_s


@dataclass(frozen=True)
class SimEngineConfig:
    """The simulated engine (`generator.engine: sim`): latency model and completion lengths."""

    latency: LatencyModel = field(default_factory=LatencyModel)
    """Seconds per decode step and per prefilled token; defaults: Qwen3-8B on one H100."""
    length_median_tokens: float = 256.0
    """Median completion length. Lengths are log-normal (median x e^(sigma N(0,1))), rounded, at
    least 1, and cut at generator.max_new_tokens (such a completion is TRUNCATED, as vLLM's)."""
    length_sigma: float = 1.0
    """Spread of the log-normal: 0 gives every completion the median; 1 puts the 99th percentile at
    about 10x the median (the long tail of reasoning traces)."""
    prefetch_s: float = 1.6
    """A weight update's fetch and staging beside the served version, before the swap (the engine
    keeps decoding meanwhile): 16.4 GB at about 10 GB/s host to device."""
    swap_paused_s: float = 0.003
    """Paused for the swap itself with the staged loader (a reference swap, docs/weight_store.md). With generator.swap_kv recompute a prefill of every token in flight is added."""
    time_scale: float = 1.0
    """Wall seconds per simulated second: 0.1 runs the simulation 10x faster than the GPU would
    (the control plane's own costs then weigh 10x more against it)."""
    idle_priority: bool = True
    """Run each simulated generator's process under Linux's SCHED_IDLE policy, every thread of it:
    it gets a core only when the run's other processes leave one. A simulated generator stands in
    for an engine on a GPU host of its own; on one machine its process (Monarch's runtime, its
    message handling, the timers) would otherwise take cores from the control plane it is measured
    against, and the rollouts' event loop would wait for a core. A higher nice value alone does not
    do it: a hundred processes outweigh one however low each is. False: the same priority as the
    rest of the run."""

    def __post_init__(self) -> None:
        checks = {
            "length_median_tokens": (self.length_median_tokens >= 1, ">= 1"),
            "length_sigma": (0 <= self.length_sigma < math.inf, ">= 0 and finite"),
            "prefetch_s": (0 <= self.prefetch_s < math.inf, ">= 0 and finite"),
            "swap_paused_s": (0 <= self.swap_paused_s < math.inf, ">= 0 and finite"),
            "time_scale": (0 < self.time_scale < math.inf, "> 0 and finite"),
        }
        for name, (ok, constraint) in checks.items():
            if not ok:
                raise ValueError(
                    f"generator.sim.{name} ({getattr(self, name)}) must be {constraint}. "
                    f"Set --generator.sim.{name.replace('_', '-')}."
                )

    def draw_length(self, rng: random.Random, max_tokens: int) -> int:
        length = round(self.length_median_tokens * math.exp(self.length_sigma * rng.gauss(0.0, 1.0)))
        return max(1, min(length, max_tokens))


@dataclass(frozen=True)
class SimTrainerConfig:
    """The simulated trainer step (`trainer.engine: sim`): a wait of
    step_fixed_s + step_per_token_s x (prompt + completion tokens in the batch), then a new version.

    Defaults: Qwen3-8B trained with FSDP on 8 H100s at 40% MFU: 6 x 8.2 GFLOP per token over
    8 x 989 x 0.4 TFLOP/s = 15.6 us per token, plus 0.5 s per step for the optimizer and gradient
    reduction."""

    step_fixed_s: float = 0.5
    """Simulated seconds of every step whatever its batch: the optimizer step and the gradient reduction."""
    step_per_token_s: float = 1.56e-5
    """Simulated seconds per trained token: forward and backward."""
    time_scale: float = 1.0
    """Wall seconds per simulated second (set it equal to generator.sim.time_scale)."""

    def __post_init__(self) -> None:
        for name in ("step_fixed_s", "step_per_token_s"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(
                    f"trainer.sim.{name} ({getattr(self, name)}) must be >= 0 and finite. "
                    f"Set --trainer.sim.{name.replace('_', '-')}."
                )
        if not 0 < self.time_scale < math.inf:
            raise ValueError(f"trainer.sim.time_scale ({self.time_scale}) must be > 0. Set --trainer.sim.time-scale.")

    def step_s(self, num_tokens: int) -> float:
        """Wall seconds of one simulated step over `num_tokens` tokens."""
        return (self.step_fixed_s + num_tokens * self.step_per_token_s) * self.time_scale


@dataclass
class _Sequence:
    """One completion being decoded."""

    context_tokens: int
    """Prompt + tokens generated so far: what each decode step reads from its KV."""
    target_tokens: int
    """How many tokens it will generate (drawn at admission)."""
    done: asyncio.Future
    arrived_at: float = 0.0
    """Loop time its request reached the engine: its prefill starts no earlier."""
    generated: int = 0
    version_spans: list[list[int]] = field(default_factory=list)
    """[[policy_version, num_tokens], ...] in order: the per-token versions, compressed."""

    def advance(self, num_tokens: int, policy_version: int) -> None:
        if self.version_spans and self.version_spans[-1][0] == policy_version:
            self.version_spans[-1][1] += num_tokens
        else:
            self.version_spans.append([policy_version, num_tokens])
        self.generated += num_tokens
        self.context_tokens += num_tokens

    @property
    def remaining(self) -> int:
        return self.target_tokens - self.generated


class _Pause:
    """A swap's request to stop decoding: `mode` keep (at the next step boundary) or wait (once
    every admitted sequence finished); `paused` is set by the engine loop, `resume` by the swap."""

    def __init__(self, mode: str):
        self.mode = mode
        self.paused = asyncio.Event()
        self.resume = asyncio.Event()


class SimulatedEngine:
    """A simulated vLLM engine: same interface as `VLLMEngine`, no model (module docstring)."""

    def __init__(self, config, cuda_devices: tuple[int, ...] | None = None):
        # `config` is the GeneratorConfig (engines/vllm_engine.py); its `sim` holds this engine's own.
        self.config = config
        self.sim: SimEngineConfig = config.sim
        self.policy_version = 0
        self.max_model_len: int | None = None
        self._rng = random.Random(config.seed)
        self._waiting: list[tuple[_Sequence, int]] = []
        """Admitted by `generate`, not yet prefilled: (sequence, prompt tokens to prefill)."""
        self._running: list[_Sequence] = []
        self._wake = asyncio.Event()
        self._pause: _Pause | None = None
        self._core: asyncio.Task | None = None
        self._gpu_free_at: float | None = None
        """Loop time the simulated GPU finishes the work it was given last, while more work
        follows it (None once idle: the next work starts when it arrives). It runs ahead of or
        behind `loop.time()` as this process gets its core early or late (module docstring)."""
        self.num_decode_steps = 0
        """Decode steps run so far (for tests and figures)."""

    async def start(self, model_dir=None, max_model_len: int = 2**31) -> None:
        """Start the engine loop; `model_dir` is not read (there is no model)."""
        if max_model_len <= self.config.max_new_tokens:
            raise ValueError(
                f"max_model_len ({max_model_len}) must exceed generator.max_new_tokens "
                f"({self.config.max_new_tokens}) to leave room for a prompt. "
                "Lower --generator.max-new-tokens or raise max_model_len."
            )
        self.max_model_len = max_model_len
        self._core = asyncio.create_task(self._run())

    # Requests ---------------------------------------------------------------------------------

    async def generate(
        self,
        prompt_token_ids: list[int],
        n: int,
        eos_id: int | None,
        forced_length: int | None = None,
        temperature: float | None = None,
        max_new_tokens: int | None = None,
    ) -> list[Completion]:
        """`n` simulated completions of one prompt (VLLMEngine.generate's contract): lengths drawn
        from the configured distribution (exactly `forced_length` when given) within
        `max_new_tokens` (generator.max_new_tokens when None), placeholder tokens, each token stamped
        with the version it was decoded under. `temperature` changes nothing: no model samples."""
        limit = self.max_model_len - self.config.max_new_tokens
        if len(prompt_token_ids) > limit:
            raise ValueError(
                f"Prompt has {len(prompt_token_ids)} tokens; the limit is max_model_len ({self.max_model_len}) - "
                f"generator.max_new_tokens ({self.config.max_new_tokens}) = {limit}. Shorten the prompt, lower "
                "--generator.max-new-tokens, or raise max_model_len."
            )
        budget = min(max_new_tokens or self.config.max_new_tokens, self.config.max_new_tokens)  # as VLLMEngine's
        max_tokens = min(forced_length or budget, budget)
        loop = asyncio.get_running_loop()
        sequences = []
        for child in range(n):
            target = max_tokens if forced_length else self.sim.draw_length(self._rng, max_tokens)
            sequence = _Sequence(len(prompt_token_ids), target, loop.create_future(), arrived_at=loop.time())
            # The children share the prompt's KV (vLLM's prefix cache): it is prefilled once.
            self._waiting.append((sequence, len(prompt_token_ids) if child == 0 else 0))
            sequences.append(sequence)
        self._wake.set()
        await asyncio.gather(*(s.done for s in sequences))
        ends_on_eos = eos_id is not None and not forced_length
        return [self._completion(s, max_tokens, eos_id if ends_on_eos else None) for s in sequences]

    async def generate_turn(
        self, prefix_token_ids: list[int], max_new_tokens: int, *, eos_id: int | None
    ) -> SampledTurn:
        """One simulated turn after `prefix_token_ids` (VLLMEngine.generate_turn's contract): its
        length drawn from the configured distribution within `max_new_tokens` and the context,
        placeholder tokens ending on `eos_id` unless cut at that budget ("length"), each token
        stamped with the version it was decoded under. The whole prefix is prefilled: the
        simulation keeps no prefix cache, so a later turn costs what a cache miss would."""
        if self.max_model_len is None:
            raise RuntimeError("the simulated engine samples a turn only once started (start sets max_model_len)")
        room = self.max_model_len - len(prefix_token_ids)
        if room < 1:
            raise ContextExhausted(
                f"the prefix has {len(prefix_token_ids)} tokens and the simulated generator's context "
                f"(max_model_len) is {self.max_model_len}: no room for one more token."
            )
        budget = min(max_new_tokens, room)
        loop = asyncio.get_running_loop()
        sequence = _Sequence(
            len(prefix_token_ids), self.sim.draw_length(self._rng, budget), loop.create_future(), arrived_at=loop.time()
        )
        self._waiting.append((sequence, len(prefix_token_ids)))
        self._wake.set()
        await sequence.done
        turn = self._completion(sequence, budget, eos_id)
        finish: Literal["stop", "length"] = "length" if turn.status == CompletionStatus.TRUNCATED else "stop"
        return SampledTurn(turn.token_ids, turn.logprobs, turn.policy_versions, finish)

    def _completion(self, sequence: _Sequence, max_tokens: int, eos_id: int | None) -> Completion:
        truncated = eos_id is None or sequence.generated >= max_tokens
        token_ids = [PLACEHOLDER_TOKEN_ID] * sequence.generated
        if not truncated and eos_id is not None:  # eos_id is None only when truncated
            token_ids[-1] = eos_id
        versions = [version for version, count in sequence.version_spans for _ in range(count)]
        return Completion(
            token_ids,
            [PLACEHOLDER_LOGPROB] * sequence.generated,
            versions,
            status=CompletionStatus.TRUNCATED if truncated else CompletionStatus.OK,
        )

    def tokens_in_flight(self) -> int:
        """Tokens its sequences in flight have decoded so far, as of the engine loop's last step
        boundary (it advances them when a sequence ends or a request or swap wakes it): what its
        death would lose."""
        return sum(sequence.generated for sequence in self._running)

    async def generate_segment(
        self,
        prompt_token_ids: list[int],
        heads: list[list[int]] | None,
        n: int,
        eos_id: int | None,
        forced_length: int | None,
        segment_tokens: int,
    ) -> list[tuple[Completion, bool]]:
        raise EngineCannot(_NEEDS_A_MODEL.format(what="generator.segment_tokens (continuing sampled tokens)"))

    async def generate_branches(
        self, prompt_token_ids: list[int], heads: list[list[int]], n: int, eos_id: int | None, forced_length: int | None
    ) -> list[tuple[list[Completion], int]]:
        raise EngineCannot(_NEEDS_A_MODEL.format(what="branch rollouts (continuing sampled tokens)"))

    async def sample(
        self, prompt_token_ids: list[int], spec: SampleSpec, adapter_version: int, eos_id: int | None
    ) -> SampleResult:
        raise EngineCannot(_NEEDS_A_MODEL.format(what="the service's sampling (logprobs of a model)"))

    async def serve_adapter(self, adapter_dir: Path, policy_version: int, adapter_of: str | None) -> None:
        raise EngineCannot(_NEEDS_A_MODEL.format(what="LoRA adapters (trainer.lora)"))

    # Weights ----------------------------------------------------------------------------------

    async def serve_version(self, policy_version: int, open_store: Callable[[], Awaitable[Any]], exact: bool) -> dict:
        """`load_version`: the simulated trainer publishes no weights, so no store is opened."""
        return await self.load_version(policy_version)

    async def load_version(self, policy_version: int) -> dict:
        """A weight update as `forge_rl.store.loader`'s `load_version` reports it: the simulated
        prefetch and staging (decoding goes on), then the swap. There is no store: the simulated
        trainer publishes no weights, only version numbers."""
        from forge_rl.store.loader import LOAD_S, PAUSED_S, PREFETCH_S, STALL_S

        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.sleep(self.sim.prefetch_s * self.sim.time_scale)
        swap = await self.swap_weights(None, policy_version, self.config.swap_mode)
        return {
            "policy_version": self.policy_version,
            "simulated": True,
            PREFETCH_S: self.sim.prefetch_s * self.sim.time_scale,
            STALL_S: swap.stall_s,
            PAUSED_S: swap.paused_s,
            LOAD_S: loop.time() - started,
        }

    async def swap_weights(self, weights_dir, policy_version: int, mode: str = "keep", loader=None, swap_kv=None):
        """Pause between two decode steps (keep), or once every admitted sequence finished (wait),
        swap, resume; tokens decoded from then on carry `policy_version`. mode abort is simulated
        as keep with the prefixes recomputed (what vLLM's abort and resubmit costs). Returns the
        same SwapStats as VLLMEngine.swap_weights."""
        from forge_rl.types import SwapStats

        loop = asyncio.get_running_loop()
        recompute = mode == "abort" or (swap_kv or self.config.swap_kv) == "recompute"
        pause = _Pause("wait" if mode == "wait" else "keep")
        while self._pause is not None:  # one swap at a time
            await self._pause.resume.wait()
        self._pause = pause
        self._wake.set()
        started = loop.time()
        await pause.paused.wait()
        paused = loop.time()
        over_older_kv = 0 if recompute or pause.mode == "wait" else len(self._running)
        paused_s = self.sim.swap_paused_s
        if recompute:
            paused_s += self.sim.latency.prefill_s(sum(s.context_tokens for s in self._running))
        await asyncio.sleep(paused_s * self.sim.time_scale)
        self.policy_version = policy_version
        self._pause = None
        pause.resume.set()
        self._wake.set()
        resumed = loop.time()
        return SwapStats(
            policy_version=policy_version,
            mode=mode,
            loader="simulated",
            stage_s=0.0,
            pause_s=paused - started,
            load_s=resumed - paused,
            stall_s=resumed - started,
            paused_s=resumed - paused,
            num_bytes=0,
            num_requests_over_older_kv=over_older_kv,
        )

    # The engine loop --------------------------------------------------------------------------

    async def _run(self) -> None:
        """One loop, like vLLM's engine core: honour a pause, admit and prefill, decode until the
        next event."""
        latency, scale = self.sim.latency, self.sim.time_scale
        while True:
            self._wake.clear()
            pause = self._pause
            if pause is not None and (pause.mode == "keep" or not self._running):
                pause.paused.set()
                await pause.resume.wait()
                self._gpu_free_at = None  # the swap's own wait timed its stall; work resumes now
                continue
            admitting = pause is None  # a wait-mode pause lets no new request start
            if admitting and self._waiting and len(self._running) < self.config.max_num_seqs:
                await self._admit(latency, scale)
                continue
            if not self._running:
                self._gpu_free_at = None
                await self._wake.wait()
                continue
            await self._decode(latency, scale)

    def _work_starts(self, arrived_at: float = -math.inf) -> float:
        """When the simulated GPU starts work that arrived at `arrived_at` (default: work in hand,
        the next decode steps): when it is free of its earlier work, or now if it was idle."""
        if self._gpu_free_at is None:
            return asyncio.get_running_loop().time()
        return max(self._gpu_free_at, arrived_at)

    async def _admit(self, latency: LatencyModel, scale: float) -> None:
        """Prefill what fits in the batch; the prefill samples each sequence's first token."""
        room = self.config.max_num_seqs - len(self._running)
        admitted, self._waiting = self._waiting[:room], self._waiting[room:]
        start = self._work_starts(max(sequence.arrived_at for sequence, _ in admitted))
        self._gpu_free_at = start + latency.prefill_s(sum(prompt for _, prompt in admitted)) * scale
        await asyncio.sleep(max(0.0, self._gpu_free_at - asyncio.get_running_loop().time()))
        for sequence, _ in admitted:
            sequence.advance(1, self.policy_version)
            self._running.append(sequence)
        self._finish_done()

    async def _decode(self, latency: LatencyModel, scale: float) -> None:
        """Decode until the first running sequence finishes, or until woken (a request, a swap):
        then the step in progress completes, and the loop re-plans at that step boundary."""
        batch = len(self._running)
        context = sum(s.context_tokens for s in self._running)
        planned = min(s.remaining for s in self._running)
        loop = asyncio.get_running_loop()
        started = self._work_starts()
        planned_end = started + latency.decode_s(batch, context, planned) * scale
        try:
            # Behind (this process ran late), the wait is 0 and the planned steps are done at once.
            await asyncio.wait_for(self._wake.wait(), max(0.0, planned_end - loop.time()))
            steps = min(planned, latency.steps_within(batch, context, (loop.time() - started) / scale) + 1)
            step_end = started + latency.decode_s(batch, context, steps) * scale
            await asyncio.sleep(max(0.0, step_end - loop.time()))
        except TimeoutError:
            steps, step_end = planned, planned_end
        self._gpu_free_at = step_end
        for sequence in self._running:
            sequence.advance(steps, self.policy_version)
        self.num_decode_steps += steps
        self._finish_done()

    def _finish_done(self) -> None:
        still = []
        for sequence in self._running:
            if sequence.remaining > 0:
                still.append(sequence)
            elif not sequence.done.done():
                sequence.done.set_result(None)
        self._running = still

    # Same surface as VLLMEngine ---------------------------------------------------------------

    def process_ids(self) -> list[int]:
        """A simulated engine runs in its generator's process: no processes of its own."""
        return []

    async def forward_time(self) -> dict:
        """A simulation runs no model: no forward time to report."""
        return {}

    async def worker_devices(self) -> list[dict]:
        return [{"device": "simulated"}]

    async def shutdown(self) -> None:
        if self._core is not None:
            self._core.cancel()
            await asyncio.gather(self._core, return_exceptions=True)
            self._core = None
        for sequence, _ in self._waiting:
            sequence.done.cancel()
        for sequence in self._running:
            sequence.done.cancel()
