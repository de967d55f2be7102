"""`forge-rl bench weight-sync`: how fast a published version becomes servable, and what a swap costs.

Four parts, in one process that is also the Monarch client; every figure is compared with plain
memcpy bandwidth measured in the same run (one thread, preallocated buffers, best of 3):

1. Store throughput: state dicts of 10 MB to 2 GB published through the store (this process
   writes, as the trainer does) to a reader in its own proc mesh that waits for the version,
   leases it and copies it into preallocated tensors (what a model load does). publish-to-servable
   = time from the publish call to the reader holding a verified copy. Same-host readers map the
   writer's file (transport shm); a second reader is forced onto RDMABuffer (TCP fallback without RDMA),
   the cross-host path: one read into its own /dev/shm, then the copy.
2. Trainer step time with synchronous vs background publishing (a real PolicyTrainer on the
   served model, the dtype the generator serves).
3. A real vLLM engine serving a ~100M-parameter Llama under load (requests in flight all the
   time), one update after another, per policy: in-flight swap (staged loader, KV kept), in-flight
   with KV recomputed, in-flight with vLLM's stock reload, drain, abort-and-resubmit. Per update:
   the decode stall seen by a streaming probe request (its longest gap between two tokens across
   the swap minus its median gap), the paused time, publish-to-servable.
4. The same engine updated over RDMA from a storage volume in another proc mesh.

Figures go to OUT_DIR/weight_sync.json; the last line of stdout is the JSON summary.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from monarch.actor import Actor, endpoint

from forge_rl.plumbing.proc_main import spawn_procs

if TYPE_CHECKING:
    from forge_rl.store.client import WeightStore

_MB = 10**6
# Versions published before timing: keep_latest=1 leaves the first files in the pool by the third.
_WARMUP_VERSIONS = 2


@dataclass(frozen=True)
class WeightSyncArgs:
    out_dir: Path = Path("runs/bench-weight-sync")
    """Where weight_sync.json goes."""
    sizes_mb: tuple[int, ...] = (10, 100, 500, 1000, 2000)
    """State dict sizes for the store-throughput part (MB = 1e6 bytes)."""
    rounds: int = 3
    """Timed publishes per size, after two warm-ups (they allocate the shared-memory files that
    later versions recycle, and every process's mappings of them)."""
    rdma_max_mb: int = 1000
    """Largest size also read by the RDMA reader (the TCP fallback is far slower than shared memory)."""
    trainer_steps: int = 3
    """Training steps per publishing mode in the trainer part; 0 skips it."""
    engine: bool = True
    """Run the vLLM parts (3 and 4)."""
    hidden_size: int = 768
    num_layers: int = 8
    intermediate_size: int = 2048
    vocab_size: int = 32000
    num_heads: int = 12
    num_kv_heads: int = 4
    updates_per_policy: int = 3
    """Weight updates per swap policy in part 3."""
    concurrency: int = 16
    """Requests kept in flight by the load generator (besides the probe)."""
    max_new_tokens: int = 48
    """Tokens per load request (drain waits for the longest in flight)."""
    policies: tuple[str, ...] = (
        "in_flight",
        "in_flight_recompute",
        "in_flight_stock_reload",
        "drain",
        "abort_resubmit",
    )
    """Swap policies of part 3 (POLICIES); the summary needs in_flight and drain."""


# Part 1: the store ----------------------------------------------------------------------------


def memcpy_gbps(num_bytes: int, repeats: int = 3) -> float:
    """Plain memcpy bandwidth between two preallocated, touched buffers (best of `repeats`)."""
    source = torch.ones(num_bytes, dtype=torch.uint8)
    destination = torch.zeros(num_bytes, dtype=torch.uint8)
    best = min(_timed(lambda: destination.copy_(source)) for _ in range(repeats))
    return num_bytes / best / 1e9


def synthetic_shapes(num_bytes: int, num_tensors: int = 16) -> dict[str, tuple[int, int]]:
    """`num_tensors` fp32 tensors of 1024 columns, `num_bytes` in all."""
    rows = max(1, num_bytes // (num_tensors * 1024 * 4))
    return {f"layers.{i}.weight": (rows, 1024) for i in range(num_tensors)}


def synthetic_state_dict(num_bytes: int, version: int) -> dict[str, torch.Tensor]:
    """Tensor i of version v is filled with v + i, so a reader can tell versions apart."""
    return {
        name: torch.full(shape, float(version + i))
        for i, (name, shape) in enumerate(synthetic_shapes(num_bytes).items())
    }


async def store_throughput(args: WeightSyncArgs, workdir: Path) -> list[dict]:
    from monarch.actor import this_host

    from forge_rl.store.actors import open_store

    procs = {name: spawn_procs(this_host(), f"bench_{name}") for name in ("volume", "shm", "rdma")}
    readers = {t: procs[t].spawn("reader", BenchReader, t) for t in ("shm", "rdma")}
    results = []
    try:
        for size_mb in args.sizes_mb:
            root = workdir / f"store-{size_mb}mb"
            index, _ = await open_store(root, keep_latest=1, procs=procs["volume"])
            results.append(await _one_size(args, index, root, size_mb, readers))
            _progress(f"store {size_mb} MB: {json.dumps(results[-1])}")
            await index.drop_reader.call_one("bench")
            for reader in readers.values():
                await reader.reset.call_one()
            _remove(root)
    finally:
        await asyncio.gather(*(p.stop() for p in procs.values()), return_exceptions=True)
    return results


async def _one_size(args: WeightSyncArgs, index, root: Path, size_mb: int, readers: dict) -> dict:
    from forge_rl.store.client import WeightStore

    writer = WeightStore(index, root, client_id="bench-writer")
    shapes = synthetic_shapes(size_mb * _MB)
    num_bytes = sum(rows * cols * 4 for rows, cols in shapes.values())
    memcpy = memcpy_gbps(num_bytes)
    transports = ["shm"] + (["rdma"] if size_mb <= args.rdma_max_mb else [])
    per_transport: dict[str, list[dict]] = {t: [] for t in transports}
    checks: dict[str, list[bool]] = {t: [] for t in transports}  # content of every version, checksums of one
    version = 0
    for t in transports:  # one transport at a time: two readers would share the two cores
        await readers[t].prepare.call_one(str(root), shapes)
        for round_ in range(args.rounds + _WARMUP_VERSIONS):
            state_dict = synthetic_state_dict(size_mb * _MB, version)
            verify = round_ == _WARMUP_VERSIONS - 1  # checksums checked on the last warm-up, untimed
            read = asyncio.ensure_future(readers[t].read.call_one(version, verify=verify))
            await asyncio.sleep(0.05)  # the reader is waiting on the index
            published_at = time.monotonic()
            stats = await writer.publish(version, state_dict)
            result = await read
            checks[t].append(result["checksums_ok"])
            if round_ >= _WARMUP_VERSIONS:
                per_transport[t].append(
                    {
                        **result,
                        "publish_to_servable_s": result["servable_at"] - published_at,
                        "write_s": stats.write_s,
                        "recycled": stats.recycled,
                    }
                )
            del state_dict
            version += 1
    row: dict[str, Any] = {
        "size_mb": round(num_bytes / _MB),
        "num_bytes": num_bytes,
        "memcpy_gbps": memcpy,
        "memcpy_s": num_bytes / memcpy / 1e9,
    }
    for t, samples in per_transport.items():
        worst = max(samples, key=lambda s: s["publish_to_servable_s"])
        gbps = num_bytes / worst["publish_to_servable_s"] / 1e9
        row[t] = {
            "publish_to_servable_s": worst["publish_to_servable_s"],
            "publish_to_servable_gbps": gbps,
            "vs_memcpy": gbps / memcpy,
            "write_s": max(s["write_s"] for s in samples),
            "fetch_s": max(s["fetch_s"] for s in samples),
            "copy_s": max(s["copy_s"] for s in samples),
            "checksums_ok": all(checks[t]),
            "pages_recycled": all(s["recycled"] for s in samples),
        }
    return row


class BenchReader(Actor):
    """A generator stand-in in its own proc mesh: waits for a version, leases it, copies it into
    preallocated tensors (what a model load does; "servable" once copied)."""

    def __init__(self, transport: Literal["shm", "rdma"]):
        torch.set_num_threads(1)
        self.transport = transport
        self.store: WeightStore | None = None
        self.destination: dict[str, torch.Tensor] = {}

    @endpoint
    async def prepare(self, root: str, shapes: dict) -> None:
        from forge_rl.store.actors import find_index
        from forge_rl.store.client import WeightStore

        self.store = WeightStore(
            await find_index(root), root, client_id=f"bench-{self.transport}", transport=self.transport
        )
        self.destination = {name: torch.zeros(shape) for name, shape in shapes.items()}

    @endpoint
    async def read(self, version: int, verify: bool = False) -> dict:
        if self.store is None:
            raise RuntimeError("BenchReader.read before prepare: no store to lease from")
        async with self.store.lease(min_version=version) as snapshot:
            if verify:
                snapshot.verify()  # raises ChecksumError on a mismatch
            with snapshot.open() as tensors:
                copy_started = time.perf_counter()
                await asyncio.to_thread(_copy_all, self.destination, tensors)
                copy_s = time.perf_counter() - copy_started
            servable_at = time.monotonic()
        # synthetic_state_dict fills tensor i of version v with v + i: every copy must show it.
        content_ok = all(
            float(t[0, 0]) == float(t[-1, -1]) == version + i for i, t in enumerate(self.destination.values())
        )
        return {
            "servable_at": servable_at,
            "fetch_s": snapshot.fetch_s,
            "copy_s": copy_s,
            "verified": verify,
            "checksums_ok": content_ok,
            "transport": snapshot.transport,
        }

    @endpoint
    async def reset(self) -> None:
        if self.store is not None:
            await self.store.close()
        self.store, self.destination = None, {}


def _copy_all(destination: dict[str, torch.Tensor], source: dict[str, torch.Tensor]) -> None:
    for name, tensor in source.items():
        destination[name].copy_(tensor)


# Part 2: the trainer --------------------------------------------------------------------------


async def trainer_publish(args: WeightSyncArgs, model_dir: Path, workdir: Path) -> dict:
    """Step time of a real PolicyTrainer with synchronous vs background publishing."""
    from forge_rl.core.batching import make_train_batch
    from forge_rl.store.actors import open_store
    from forge_rl.store.client import WeightStore
    from forge_rl.store.publisher import PublishConfig, WeightPublisher
    from forge_rl.training.trainer import PolicyTrainer, TrainerConfig
    from forge_rl.types import Completion, Episode

    trainer = PolicyTrainer(TrainerConfig(), model_dir)
    generator = torch.Generator().manual_seed(0)
    episodes = [
        Episode(
            i,
            "",
            "",
            torch.randint(3, args.vocab_size, (16,), generator=generator).tolist(),
            [
                Completion(
                    torch.randint(3, args.vocab_size, (48,), generator=generator).tolist(),
                    [-1.0] * 48,
                    [0] * 48,
                    reward=float(j % 2),
                )
                for j in range(2)
            ],
        )
        for i in range(2)
    ]
    batch = make_train_batch(episodes, pad_id=0)
    root = workdir / "trainer-store"
    index, _ = await open_store(root, model_dir, keep_latest=1)
    results: dict[str, Any] = {}
    for mode, background in (("sync", False), ("background", True)):
        config = PublishConfig(background=background)
        publisher = WeightPublisher(WeightStore(index, root, extra_files_dir=model_dir), config)
        step_s, blocking_s = [], []
        for step in range(args.trainer_steps + 1):
            started = time.perf_counter()
            trainer.train_step(batch)
            trained = time.perf_counter()
            snapshot = trainer.hf_state_dict(config.torch_dtype())
            snapshot_s = time.perf_counter() - trained
            await publisher.publish(trainer.policy_version, snapshot, snapshot_s)
            del snapshot
            if step > 0:  # the first step of each mode warms up
                step_s.append(time.perf_counter() - started)
                blocking_s.append(time.perf_counter() - trained)
        await publisher.flush()
        results[mode] = {
            "step_s": statistics.median(step_s),
            "publish_blocking_s": statistics.median(blocking_s),
            "write_s": publisher._last_write.get("weights/write_s"),
        }
    _remove(root)
    results["step_time_saved_s"] = results["sync"]["step_s"] - results["background"]["step_s"]
    results["dtype"] = str(PublishConfig().torch_dtype())
    return results


# Part 3: the engine ---------------------------------------------------------------------------


def create_model(args: WeightSyncArgs, model_dir: Path) -> tuple[Path, int]:
    """A random Llama of about 100M parameters, fp32, saved as an HF directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        head_dim=args.hidden_size // args.num_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(model_dir, safe_serialization=True)
    return model_dir, sum(p.numel() for p in model.parameters())


class Load:
    """`concurrency` requests always in flight, and an optional streaming probe timing each token."""

    def __init__(self, engine, args: WeightSyncArgs, probe: bool, varied_lengths: bool = False):
        self.engine, self.args = engine, args
        self.varied_lengths = varied_lengths
        """Each request's length drawn from [max_new_tokens / 2, max_new_tokens] instead of all
        max_new_tokens. Requests of one length that start in the same step end in the same step,
        and their successors' prefills then share one step: with LoRA on CPU (vLLM gathers every
        token's adapter matrices) such a step of several prefills takes several decode steps' time,
        and it lands next to whatever the benchmark times."""
        self.stopping = False
        self.token_times: list[float] = []
        self.tasks = [asyncio.ensure_future(self._worker(i)) for i in range(args.concurrency)]
        if probe:
            self.tasks.append(asyncio.ensure_future(self._probe()))

    async def _worker(self, i: int) -> None:
        generator = torch.Generator().manual_seed(i)
        while not self.stopping:
            prompt = torch.randint(3, self.args.vocab_size, (16,), generator=generator).tolist()
            longest = self.engine.config.max_new_tokens
            length = (
                int(torch.randint(longest // 2, longest + 1, (1,), generator=generator))
                if self.varied_lengths
                else None
            )
            await self.engine.generate(prompt, 1, None, forced_length=length)

    async def _probe(self) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(max_tokens=1900, ignore_eos=True, temperature=1.0, output_kind=RequestOutputKind.DELTA)
        while not self.stopping:  # restarted if an abort-mode swap aborts it
            async for _ in self.engine._running_llm.generate(
                self.engine.prompt([1, 5, 6, 7]), params, f"probe-{time.monotonic_ns()}"
            ):
                self.token_times.append(time.perf_counter())
                if self.stopping:
                    break

    async def stop(self) -> None:
        self.stopping = True
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def stall_across(self, start: float, end: float) -> tuple[float, float] | None:
        """(longest probe gap spanning [start, end] minus the median gap, median gap)."""
        times = self.token_times
        gaps = [b - a for a, b in zip(times, times[1:])]
        if len(gaps) < 10:
            return None
        median = statistics.median(gaps)
        spanning = [b - a for a, b in zip(times, times[1:]) if b >= start and a <= end]
        return (max(spanning) - median if spanning else 0.0), median


def perturbed(base: dict[str, torch.Tensor], version: int) -> dict[str, torch.Tensor]:
    """Version `version` of the weights: the base, every tensor shifted a little."""
    return {name: tensor + 1e-3 * version for name, tensor in base.items()}


POLICIES: dict[str, tuple[str, dict[str, Any], bool]] = {
    # name: (swap_mode, overrides for swap_weights, probe)
    "in_flight": ("keep", {"loader": "staged", "swap_kv": "reuse"}, True),
    "in_flight_recompute": ("keep", {"loader": "staged", "swap_kv": "recompute"}, True),
    "in_flight_stock_reload": ("keep", {"loader": "reload", "swap_kv": "reuse"}, True),
    "drain": ("wait", {"loader": "staged", "swap_kv": "reuse"}, False),
    "abort_resubmit": ("abort", {"loader": "staged", "swap_kv": "reuse"}, True),
}


async def engine_updates(args: WeightSyncArgs, model_dir: Path, workdir: Path, served_bytes: int) -> dict:
    from monarch.actor import this_host
    from safetensors.torch import load_file

    from forge_rl.engines.config import GeneratorConfig
    from forge_rl.engines.vllm_engine import VLLMEngine
    from forge_rl.store import loader
    from forge_rl.store.actors import open_store
    from forge_rl.store.client import WeightStore
    from forge_rl.store.loader import GBPS, PAUSED_S, PUBLISH_TO_SERVABLE_S, STAGE_S, STALL_S, load_version

    memcpy = memcpy_gbps(served_bytes)
    memcpy_s = served_bytes / memcpy / 1e9
    base = load_file(str(model_dir / "model.safetensors"))
    root = workdir / "engine-store"
    volume_procs = spawn_procs(this_host(), "bench_engine_volume")
    index, _ = await open_store(root, model_dir, keep_latest=1, procs=volume_procs)
    writer = WeightStore(index, root, client_id="bench-trainer", extra_files_dir=model_dir)
    reader = WeightStore(index, root, client_id="bench-generator", extra_files_dir=model_dir)
    engine = VLLMEngine(
        GeneratorConfig(max_new_tokens=args.max_new_tokens, swap_kv="reuse", max_num_seqs=64, kv_cache_space_gib=2.0)
    )
    started = time.perf_counter()
    await engine.start(model_dir, 2048)
    results: dict[str, Any] = {
        "engine_start_s": time.perf_counter() - started,
        "memcpy_gbps": memcpy,
        "memcpy_s": memcpy_s,
        "served_bytes": served_bytes,
    }
    version = 0
    try:
        for policy in args.policies:
            swap_mode, overrides, probe = POLICIES[policy]
            load = Load(engine, args, probe)
            await asyncio.sleep(3.0)  # the load reaches steady state
            updates = []
            for _ in range(args.updates_per_policy):
                version += 1
                publish = asyncio.ensure_future(writer.publish(version, perturbed(base, version)))
                metrics = await load_version(engine, reader, version, swap_mode, **overrides)
                resumed = time.perf_counter()
                write = await publish
                await asyncio.sleep(1.5)  # tokens after the swap, for the probe's gap
                stall = load.stall_across(resumed - metrics[PAUSED_S], resumed) if probe else None
                updates.append(
                    {
                        "stall_s": metrics[STALL_S],
                        "paused_s": metrics[PAUSED_S],
                        "stage_s": metrics[STAGE_S],
                        "probe_stall_s": stall[0] if stall else None,
                        "probe_median_gap_s": stall[1] if stall else None,
                        "publish_to_servable_s": metrics[PUBLISH_TO_SERVABLE_S],
                        "gbps": metrics[GBPS],
                        "loader": metrics["loader"],
                        # where publish-to-servable goes: write, commit to lease, staging (copy, repack), swap
                        "write_s": write.write_s,
                        "notice_s": metrics[loader.NOTICE_S],
                        "stage_load_s": metrics[loader.STAGE_LOAD_S],
                        "stage_process_s": metrics[loader.STAGE_PROCESS_S],
                        "stage_minor_faults": metrics[loader.STAGE_FAULTS],
                    }
                )
            await load.stop()
            results[policy] = _summarize_updates(updates, memcpy_s, served_bytes, memcpy)
            _progress(f"engine {policy}: {json.dumps(results[policy])}")
        results["rdma"] = await _rdma_update(
            engine, index, root, model_dir, writer, base, version + 1, args, memcpy, served_bytes
        )
        _progress(f"engine rdma: {json.dumps(results['rdma'])}")
    finally:
        await engine.shutdown()
        await reader.close()
        await volume_procs.stop()
        _remove(root)
    return results


async def _rdma_update(engine, index, root, model_dir, writer, base, version, args, memcpy, served_bytes) -> dict:
    """One update of the served engine read over RDMABuffer from the volume's proc mesh."""
    from forge_rl.store.client import WeightStore
    from forge_rl.store.loader import PREFETCH_S, PUBLISH_TO_SERVABLE_S, STAGE_S, load_version

    remote = WeightStore(index, root, client_id="bench-remote-generator", transport="rdma", extra_files_dir=model_dir)
    load = Load(engine, args, probe=False)
    await asyncio.sleep(2.0)
    publish = asyncio.ensure_future(writer.publish(version, perturbed(base, version)))
    metrics = await load_version(engine, remote, version, "keep", verify=True, loader="staged", swap_kv="reuse")
    await publish
    await load.stop()
    await remote.close()
    seconds = metrics[PUBLISH_TO_SERVABLE_S]
    return {
        "transport": metrics["transport"],
        "verified": metrics["verified"],
        "fetch_and_verify_s": metrics[PREFETCH_S],
        "fetch_gbps": served_bytes / metrics[PREFETCH_S] / 1e9,
        "stage_s": metrics[STAGE_S],
        "publish_to_servable_s": seconds,
        "vs_memcpy": served_bytes / seconds / 1e9 / memcpy,
    }


def _summarize_updates(updates: list[dict], memcpy_s: float, served_bytes: int, memcpy: float) -> dict:
    probe = [u["probe_stall_s"] for u in updates if u["probe_stall_s"] is not None]
    worst_pts = max(u["publish_to_servable_s"] for u in updates)
    summary = {
        "updates": updates,
        "stall_ms_max": 1e3 * max(u["stall_s"] for u in updates),
        "paused_ms_max": 1e3 * max(u["paused_s"] for u in updates),
        "stage_s_max": max(u["stage_s"] for u in updates),
        "publish_to_servable_s_max": worst_pts,
        "publish_to_servable_vs_memcpy": served_bytes / worst_pts / 1e9 / memcpy,
    }
    if probe:
        summary["probe_stall_ms_max"] = 1e3 * max(probe)
        summary["probe_median_gap_ms"] = 1e3 * statistics.median(
            u["probe_median_gap_s"] for u in updates if u["probe_median_gap_s"] is not None
        )
        summary["decode_stall_vs_memcpy_max"] = max(probe) / memcpy_s
    return summary


# The whole benchmark ---------------------------------------------------------------------------


def main(args: WeightSyncArgs) -> dict:
    return asyncio.run(_main(args))


async def _main(args: WeightSyncArgs) -> dict:
    torch.set_num_threads(1)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    workdir = (
        Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    ) / f"forge_rl-bench-{time.monotonic_ns()}"
    workdir.mkdir(parents=True)
    model_root = Path(tempfile.mkdtemp(prefix="forge_rl-bench-model-"))  # 400 MB: not kept
    started = time.perf_counter()
    try:
        figures: dict = {
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(args).items()},
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        _progress("part 1: store throughput, 10 MB to 2 GB")
        figures["store"] = await store_throughput(args, workdir)
        model_dir, num_params = create_model(args, model_root)
        served_bytes = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
        figures["model"] = {"num_params": num_params, "served_bytes": served_bytes, "dtype": "float32"}
        if args.trainer_steps:
            _progress("part 2: trainer step time, synchronous vs background publishing")
            figures["trainer"] = await trainer_publish(args, model_dir, workdir)
            _progress(f"trainer: {json.dumps(figures['trainer'])}")
        if args.engine:
            _progress(f"part 3-4: vLLM engine serving {num_params / 1e6:.0f}M parameters under load")
            figures["engine"] = await engine_updates(args, model_dir, workdir, served_bytes)
        figures["wall_s"] = time.perf_counter() - started
        figures["summary"] = summarize(figures)
    finally:
        _remove(workdir)
        _remove(model_root)
    (args.out_dir / "weight_sync.json").write_text(json.dumps(figures, indent=2))
    return figures["summary"]


def summarize(figures: dict) -> dict:
    # The ratios are read at 100 MB and up (below, fixed costs dominate); None when --sizes-mb has none.
    big = [row for row in figures["store"] if row["size_mb"] >= 100]
    summary = {
        "publish_to_servable_vs_memcpy": min((row["shm"]["vs_memcpy"] for row in big), default=None),
        "publish_to_servable_vs_memcpy_rdma": min(
            (row["rdma"]["vs_memcpy"] for row in big if "rdma" in row), default=None
        ),
        "memcpy_gbps": statistics.median(row["memcpy_gbps"] for row in figures["store"]),
        "store_checksums_ok": all(
            row[t]["checksums_ok"] for row in figures["store"] for t in ("shm", "rdma") if t in row
        ),
    }
    if "trainer" in figures:
        summary["trainer_step_s_sync"] = figures["trainer"]["sync"]["step_s"]
        summary["trainer_step_s_background"] = figures["trainer"]["background"]["step_s"]
    engine = figures.get("engine")
    if engine:
        summary.update(
            {
                "decode_stall_ms_inflight_max": engine["in_flight"]["probe_stall_ms_max"],
                "decode_stall_vs_memcpy_inflight_max": engine["in_flight"]["decode_stall_vs_memcpy_max"],
                "paused_ms_inflight_max": engine["in_flight"]["paused_ms_max"],
                "decode_stall_ms_drain_max": engine["drain"]["stall_ms_max"],
                **{
                    f"decode_stall_ms_{name}_max": engine[policy]["probe_stall_ms_max"]
                    for name, policy in (
                        ("inflight_recompute", "in_flight_recompute"),
                        ("stock_reload", "in_flight_stock_reload"),
                        ("abort_resubmit", "abort_resubmit"),
                    )
                    if policy in engine
                },
                "drain_over_inflight": engine["drain"]["stall_ms_max"]
                / max(engine["in_flight"]["probe_stall_ms_max"], 1e-3),
                "engine_publish_to_servable_vs_memcpy": engine["in_flight"]["publish_to_servable_vs_memcpy"],
                "engine_rdma_publish_to_servable_s": engine["rdma"]["publish_to_servable_s"],
                "served_mb": engine["served_bytes"] / _MB,
                "memcpy_ms_served": engine["memcpy_s"] * 1e3,
            }
        )
    summary["wall_s"] = figures["wall_s"]
    return summary


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _remove(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def _progress(message: str) -> None:
    from forge_rl.observability.metrics import progress

    progress(message)
