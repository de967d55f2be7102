"""The generator's settings (`GeneratorConfig`): read by the generator actors and by both engines, vLLM's
(`forge_rl.engines.vllm_engine.VLLMEngine`) and the simulated one (`forge_rl.engines.simulated.SimulatedEngine`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from forge_rl.engines.simulated import SimEngineConfig


@dataclass(frozen=True)
class GeneratorConfig:
    engine: Literal["vllm", "sim"] = "vllm"
    """"vllm": the real engine. "sim": a SIMULATED engine with no model (placeholder tokens,
    decode timed by a GPU-calibrated latency model: `forge_rl.engines.simulated`), for testing the
    control plane at scale; needs trainer.engine sim too, and never trains anything."""
    sim: SimEngineConfig = field(default_factory=SimEngineConfig)
    """The simulated engine's latency model and completion lengths (read only with engine sim)."""
    max_new_tokens: int = 4
    """Most tokens sampled per completion; a completion that reaches it without EOS is TRUNCATED."""
    temperature: float = 1.0
    """Sampling temperature. A run's generators need > 0 (greedy decoding is not RL sampling:
    GRPOConfig refuses 0); 0, greedy, is for an evaluation's own engines (eval.temperature)."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 keeps the whole vocabulary."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 turns the filter off (vLLM 0.32 convention)."""
    record_sampling_support: bool = True
    """With top_p < 1 or top_k > 0: record each token's kept set (`Completion.sampling_support`)
    so the trainer renormalizes its logprobs over it. Off saves the memory of those sets (up to
    top-k ids per token), at the price of importance ratios biased below 1 by the filtered mass."""
    max_support_ids: int = 64
    """Engines without vLLM's sampling masks (its model runner V2 needs Triton, which has no CPU
    backend) read each token's kept set from its `max_support_ids` most likely processed logprobs
    instead (a filtered token's is -inf). Exact while kept sets are no larger (always, for a vocabulary
    of at most this many tokens, or top_k <= it); a larger set is recorded as its most likely ids,
    counted (`Completion.num_truncated_support`) and warned about once per engine."""
    record_entropy_top_logprobs: int = 0
    """Record each sampled token's entropy (`Completion.entropies`), estimated from this many most
    likely processed logprobs (renormalized); 0: none. Branch rollouts with branch.rule entropy set
    it (branch.entropy_top_logprobs)."""
    max_num_seqs: int = 256
    """Most sequences vLLM decodes in one batch."""
    tensor_parallel_size: int = 1
    """GPUs per generator: vLLM shards the model over this many (one worker process each), a
    contiguous block of its host's devices (`forge_rl.plumbing.placement.generator_devices`). GPU
    only; with more than 1 the swap uses vLLM's stock reload (the staged loader is TP 1 only)."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may take for weights and KV cache (GPU only)."""
    kv_cache_space_gib: float = 1.0
    """KV cache size in GiB on CPU (what VLLM_CPU_KVCACHE_SPACE sets, but fractional)."""
    kv_block_size: int | None = None
    """Tokens per KV-cache block; None: vLLM's default (16 on GPU, 128 on CPU). The prefix cache
    reuses whole blocks only, so a multi-turn episode's earlier turns are served from it only in
    whole blocks: on CPU's 128, a tiny model (context 128) never hits it. 32 suits the tiny models
    on CPU (the CPU attention backend wants multiples of 32)."""
    enforce_eager: bool = True
    """Skip CUDA graphs and torch.compile: faster start, slower decode on GPU."""
    seed: int = 0
    """Seed of the engine's sampler: one engine replays the same samples for the same requests."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "ERROR"
    """vLLM's log level in the engine processes. WARNING repeats a benign warning at every weight
    reload (rotary embeddings have no weights to load), INFO logs every request batch and swap."""
    cpu_threads: int | Literal["auto"] = 1
    """OpenMP threads of vLLM's CPU worker, unpinned; 1 leaves the other cores to the trainer.
    "auto": a share of this machine's cores beside the other roles' (`forge_rl.plumbing.threads`),
    for the policy's generators of a local run. Above 1 the engine core is spawned, not forked: a
    slower start."""
    swap_mode: Literal["keep", "wait", "abort"] = "keep"
    """How a weight swap treats requests in flight (vLLM's pause modes, same words): "keep" freezes
    them between two decode steps and continues them on the new weights; "wait" lets them finish on
    the old weights first (new requests wait); "abort" aborts them and resubmits prompt + tokens so far."""
    swap_loader: Literal["staged", "reload"] = "staged"
    """"staged": load and repack the new weights in a worker thread while decoding continues, then
    swap references while paused (`forge_rl.engines.vllm_staging`); "reload": vLLM's stock
    reload_weights from the snapshot directory while paused. Staged needs enforce_eager (else reload)."""
    swap_kv: Literal["reuse", "recompute"] = "reuse"
    """KV of in-flight requests at a swap: "reuse" continues on it (as PipelineRL does): tokens
    after the swap are sampled by v attending to a prefix encoded by v-1, and their recorded
    logprobs are those of that distribution, so the off-policy correction stays exact; the pause
    is a reference swap. "recompute" drops it and re-prefills every in-flight prefix with v
    (every token labelled v is an exact sample of v), a prefill of all tokens in flight while
    nothing decodes. Either way no new request reuses a
    prefix-cache block of an older version (requests are salted by version). docs/weight_store.md."""
    generate_timeout_s: float | None = None
    """Most seconds one generate call (one prompt's group of completions) may take. A call past it
    is treated like a dead generator (`forge_rl.actors.generator_pool`): the generator is killed
    and replaced on a fresh proc mesh, and the call's prompt is handed out again. Unset: derived
    from what a call can legitimately take (`GRPOConfig.generate_timeout_s` has the formula)."""
    update_timeout_s: float | None = None
    """Most seconds one weight update (wait for the version, lease, prefetch, stage, swap) may take;
    past it the generator is replaced the same way, and its replacement loads the newest version
    itself. Unset: `GRPOConfig.update_timeout_s` (600 s, more with swap_mode "wait")."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Weights and compute dtype of the engine. "auto": bfloat16 on GPU, float32 on CPU (where it
    matches the fp32 trainer exactly). bfloat16 on CPU reproduces a GPU generator's numerics
    against an fp32 trainer (`forge-rl bench keep-routing`)."""
    record_routing: bool = False
    """Mixture-of-experts policies (Keep Routing, `forge_rl.routing`): record the experts every
    generated token was sampled through (`Completion.routed_experts`), for trainer.keep_routing.
    On GPU vLLM returns them (`enable_return_routed_experts`); on CPU forge_rl's hook in the worker
    captures them (`forge_rl.engines.routing_capture`). Multi-turn trajectories carry them per
    turn (`GeneratedSpan.routed_experts`)."""
    segment_tokens: int | None = None
    """Decode each completion in requests of at most this many tokens (single-turn groups). Between
    two, the tokens sampled so far (with their logprobs, versions and kept sets) are held by the
    rollouts, not the engine, so a generator that dies mid-completion loses at most the segment
    it was decoding: its prompt's completions continue on a live generator from them
    (`forge_rl.pipeline.rollouts.Rollouts._generate_in_segments`). Each segment after the first
    prefills its completion's prefix again (from the prefix cache when its blocks are cached
    under the weights served then). None: one request per group, and a dead generator's prompt is
    generated again from scratch. vLLM engines only."""
    start_timeout_s: float = 900.0
    """Most seconds a generator's start (spawn, engine start, loading the newest weights) may take
    before that attempt counts as failed: tens of seconds for the tiny model on a CPU, minutes for a
    large model on a GPU. A replacement that runs past it is retried on a fresh proc mesh; the
    run's first start that does fails the run, naming this flag."""

    @property
    def yields_the_cores(self) -> bool:
        """Whether a generator's process runs at idle priority (`placement.yield_this_process`):
        a simulated one with generator.sim.idle_priority; never the real engine."""
        return self.engine == "sim" and self.sim.idle_priority

    @property
    def records_sampling_support(self) -> bool:
        """Whether each token's kept set is recorded: top-k/top-p can leave tokens out, and
        `record_sampling_support` is on."""
        return self.record_sampling_support and (self.top_p < 1.0 or self.top_k > 0)

    def __post_init__(self) -> None:
        checks = [
            ("max_new_tokens", self.max_new_tokens >= 1, ">= 1"),
            ("temperature", 0 <= self.temperature < math.inf, ">= 0 and finite (0: greedy, for evaluation only)"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", self.top_k >= 0, ">= 0 (0 = off)"),
            ("max_num_seqs", self.max_num_seqs >= 1, ">= 1"),
            ("tensor_parallel_size", self.tensor_parallel_size >= 1, ">= 1"),
            ("max_support_ids", self.max_support_ids >= 1, ">= 1"),
            ("gpu_memory_utilization", 0 < self.gpu_memory_utilization <= 1, "in (0, 1]"),
            ("kv_cache_space_gib", self.kv_cache_space_gib > 0, "> 0"),
            ("cpu_threads", self.cpu_threads == "auto" or self.cpu_threads >= 1, ">= 1 or auto"),
            ("kv_block_size", self.kv_block_size is None or self.kv_block_size >= 1, ">= 1 (or unset: vLLM's default)"),
            ("generate_timeout_s", _unset_or_finite_positive(self.generate_timeout_s), "> 0 and finite, or unset"),
            ("update_timeout_s", _unset_or_finite_positive(self.update_timeout_s), "> 0 and finite, or unset"),
            ("start_timeout_s", 0 < self.start_timeout_s < math.inf, "> 0 and finite"),
            ("segment_tokens", self.segment_tokens is None or self.segment_tokens >= 1, ">= 1 (or unset: no segments)"),
        ]
        for name, ok, rule in checks:
            if not ok:
                flag = "--generator." + name.replace("_", "-")
                raise ValueError(f"generator.{name} ({getattr(self, name)}) must be {rule}. Set {flag}.")
        if self.segment_tokens is not None and self.engine == "sim":
            raise ValueError(
                f"generator.segment_tokens ({self.segment_tokens}) needs generator.engine vllm: the simulated "
                "engine decodes each group in one piece. Unset --generator.segment-tokens."
            )


def _unset_or_finite_positive(seconds: float | None) -> bool:
    return seconds is None or 0 < seconds < math.inf
