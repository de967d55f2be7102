"""The weight store on real Monarch actors, and staged swaps in a real vLLM engine.

Store: the index and a storage volume on one proc mesh, readers on others, one of them forced onto
RDMABuffer (the TCP fallback here). Engine: a staged swap must serve exactly what a fresh engine
started on the same weights serves.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
import torch
from monarch.actor import Actor, endpoint, this_host

from forge_rl.plumbing.proc_main import spawn_procs
from forge_rl.store.actors import find_index, open_store
from forge_rl.store.client import WeightStore
from forge_rl.store.index import version_key
from forge_rl.store.layout import tensor_checksum
from tests.support.held_engine import HoldableEngine, start_held_batch
from tests.support.helpers import HANG_S

pytestmark = pytest.mark.integration


def weights(version: int, num_layers: int = 4) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(version)
    return {f"model.layers.{i}.weight": torch.randn(128, 256, generator=generator) for i in range(num_layers)} | {
        "model.norm.weight": torch.randn(256, generator=generator).to(torch.bfloat16)
    }


def expected_checksums(version: int) -> dict[str, int]:
    return {name: tensor_checksum(tensor) for name, tensor in weights(version).items()}


class Reader(Actor):
    """A generator stand-in: reads versions through the store from its own process."""

    def __init__(self, root: str, transport: str):
        self.root, self.transport = Path(root), transport
        self.store: WeightStore | None = None

    async def _store(self) -> WeightStore:
        if self.store is None:
            self.store = WeightStore(await find_index(self.root), self.root, transport=self.transport)
        return self.store

    @endpoint
    async def read(self, min_version: int) -> dict:
        """The newest complete version >= min_version, verified against its checksums."""
        store = await self._store()
        async with store.lease(min_version=min_version, timeout_s=60) as snapshot:
            version = snapshot.version
            checksums = snapshot.verify()
            with snapshot.open() as tensors:
                recomputed = {name: tensor_checksum(t) for name, t in tensors.items()}
        return {
            "version": version,
            "transport": snapshot.transport,
            "checksums": checksums,
            "recomputed": recomputed,
            "fetch_s": snapshot.fetch_s,
            "num_bytes": snapshot.num_bytes,
            "fetched_bytes": snapshot.fetched_bytes,
        }

    @endpoint
    async def read_adapter(self, min_version: int) -> dict:
        """The newest version >= min_version as a PEFT adapter directory on this reader's host:
        its files, adapter_config.json, and the tensors adapter_model.safetensors holds."""
        from safetensors.torch import load_file

        store = await self._store()
        async with store.lease(min_version=min_version, timeout_s=60) as snapshot:
            directory = Path(snapshot.path)
            return {
                "version": snapshot.version,
                "transport": snapshot.transport,
                "files": sorted(p.name for p in directory.iterdir()),
                "adapter_config": json.loads((directory / "adapter_config.json").read_text()),
                "tensors": load_file(str(directory / "adapter_model.safetensors")),
            }

    @endpoint
    async def hold(self, key: str) -> None:
        await (await self._store()).index.acquire.call_one("holder", key)

    @endpoint
    async def release(self, key: str) -> None:
        await (await self._store()).index.release.call_one("holder", key)

    @endpoint
    async def close(self) -> None:
        if self.store is not None:
            await self.store.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(loop, writer store, shm reader, rdma readers, index); readers and volume on their own meshes.
    The two rdma readers share this host's copies of fetched versions (store/host_copies.py)."""
    root = Path("/dev/shm") / f"forge_rl-test-store-{time.monotonic_ns()}"
    loop = asyncio.new_event_loop()

    async def build():
        volume_procs = spawn_procs(this_host(), "store_volume")
        index, _ = await open_store(root, keep_latest=1, procs=volume_procs)
        reader_procs = [spawn_procs(this_host(), f"reader{i}") for i in range(3)]
        shm_reader = reader_procs[0].spawn("reader", Reader, str(root), "shm")
        rdma_readers = [procs.spawn("reader", Reader, str(root), "rdma") for procs in reader_procs[1:]]
        writer = WeightStore(index, root)
        return writer, shm_reader, rdma_readers, index, [volume_procs, *reader_procs]

    writer, shm_reader, rdma_readers, index, meshes = loop.run_until_complete(build())
    yield loop, writer, shm_reader, rdma_readers, index

    async def teardown():
        for reader in rdma_readers:
            await reader.close.call_one()
        await asyncio.gather(*(m.stop() for m in meshes), return_exceptions=True)

    loop.run_until_complete(teardown())
    loop.close()
    writer.local.destroy()
    assert not Path(f"{root}-fetched-host").exists(), "the last rdma reader to close leaves its host's copies"


def test_readers_get_every_version_intact_through_both_transports(cluster):
    loop, writer, shm_reader, (rdma_reader, _), _ = cluster
    for version in (1, 2, 3):
        loop.run_until_complete(writer.publish(version, weights(version)))
        shm = loop.run_until_complete(shm_reader.read.call_one(version))
        rdma = loop.run_until_complete(rdma_reader.read.call_one(version))

        assert (shm["version"], shm["transport"]) == (version, "shm")
        assert (rdma["version"], rdma["transport"]) == (version, "rdma")
        for result in (shm, rdma):
            assert result["checksums"] == result["recomputed"] == expected_checksums(version)
    print(f"rdma read of {rdma['num_bytes'] / 1e6:.1f} MB: {rdma['fetch_s'] * 1e3:.1f} ms")


def test_a_version_crosses_to_a_host_once_however_many_readers_lease_it_there(cluster):
    loop, writer, _, rdma_readers, _ = cluster
    version = loop.run_until_complete(writer.latest_version()) + 1
    loop.run_until_complete(writer.publish(version, weights(version)))
    first, second = (loop.run_until_complete(reader.read.call_one(version)) for reader in rdma_readers)
    assert first["version"] == second["version"] == version
    assert first["fetched_bytes"] == first["num_bytes"] > 0  # fetched this host's copy
    assert second["fetched_bytes"] == 0  # mapped it
    for result in (first, second):
        assert result["checksums"] == result["recomputed"] == expected_checksums(version)


def test_an_adapter_version_crosses_hosts_as_a_peft_directory(cluster):
    """An adapter version read over RDMA (a generator on another host) is a PEFT adapter directory
    there too: the record's files recreated beside the fetched copy, the weights link pointing
    into it, the tensors exactly those published."""
    loop, writer, shm_reader, (rdma_reader, _), _ = cluster
    version = loop.run_until_complete(writer.latest_version()) + 1
    adapters = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 64),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(64, 4),
    }
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    # Blocking, as the trainer's writer thread calls it (its index calls wait on their replies).
    loop.run_until_complete(
        asyncio.to_thread(writer.publish_adapter_blocking, version, adapters, config, "/models/base")
    )
    for reader, transport in ((rdma_reader, "rdma"), (shm_reader, "shm")):
        read = loop.run_until_complete(reader.read_adapter.call_one(version))
        assert (read["version"], read["transport"]) == (version, transport)
        assert {"adapter_config.json", "adapter_model.safetensors"} <= set(read["files"])
        assert read["adapter_config"] == config
        assert read["tensors"].keys() == adapters.keys()
        assert all(torch.equal(read["tensors"][name], tensor) for name, tensor in adapters.items())


def test_a_reader_waiting_for_a_version_gets_it_only_once_complete(cluster):
    loop, writer, shm_reader, _, index = cluster

    async def scenario():
        pending = asyncio.ensure_future(shm_reader.read.call_one(10))
        # The reader's call is waiting inside the index (a state, not a guess at how long it takes).
        deadline = time.monotonic() + HANG_S
        while (await index.describe.call_one())["_waiting"] != 1:
            assert not pending.done(), pending.result()
            assert time.monotonic() < deadline, "the reader never started waiting for version 10"
        assert not pending.done()  # nothing >= 10 is complete yet
        await writer.publish(10, weights(10))
        return await pending

    result = loop.run_until_complete(scenario())
    assert result["version"] == 10
    assert result["checksums"] == expected_checksums(10)


def test_gc_never_deletes_a_version_in_use(cluster):
    loop, writer, shm_reader, _, index = cluster
    loop.run_until_complete(writer.publish(20, weights(20)))
    loop.run_until_complete(shm_reader.hold.call_one(version_key(20)))

    loop.run_until_complete(writer.publish(21, weights(21)))
    loop.run_until_complete(writer.publish(22, weights(22)))  # with keep_latest=1, 21 goes at once

    assert writer.local.exists(version_key(20))
    writer.local.verify(version_key(20))  # untouched: its file was not recycled for 21 or 22
    assert not writer.local.exists(version_key(21))
    keys = loop.run_until_complete(writer.keys())
    assert version_key(20) in keys and version_key(21) not in keys

    loop.run_until_complete(shm_reader.release.call_one(version_key(20)))
    assert not writer.local.exists(version_key(20))
    assert loop.run_until_complete(writer.keys("v")) == [version_key(22)]


def test_a_late_reader_gets_the_newest_version(cluster):
    loop, writer, _, _, _ = cluster
    for version in (30, 31, 32):
        loop.run_until_complete(writer.publish(version, weights(version)))

    async def late_join():
        procs = spawn_procs(this_host(), "late_reader")
        try:
            return await procs.spawn("reader", Reader, str(writer.local.root), "auto").read.call_one(0)
        finally:
            await procs.stop()

    result = loop.run_until_complete(late_join())
    assert result["version"] == 32
    assert result["checksums"] == expected_checksums(32)


def test_torchstore_style_put_get_keys_delete(cluster):
    loop, writer, _, _, _ = cluster
    bias = torch.arange(10, dtype=torch.float32)

    async def scenario():
        await writer.put("bias", bias)
        assert await writer.exists("bias")
        assert torch.equal(await writer.get("bias"), bias)
        into = torch.zeros(10)
        await writer.get("bias", inplace_tensor=into)
        assert torch.equal(into, bias)
        await writer.put_state_dict(weights(40), "checkpoint")
        assert torch.equal(await writer.get("checkpoint/model.layers.1.weight"), weights(40)["model.layers.1.weight"])
        copy = await writer.get_state_dict("checkpoint")
        assert all(torch.equal(copy[n], t) for n, t in weights(40).items())
        assert "bias" in await writer.keys() and "checkpoint" in await writer.keys("check")
        await writer.delete("bias")
        assert not await writer.exists("bias")

    loop.run_until_complete(scenario())
    assert not writer.local.exists("bias")


# The engine: staged swaps serve exactly what a fresh engine on the same weights serves ----------

MAX_MODEL_LEN = 128
NEW_TOKENS = 96
HOLD_AFTER_TOKENS = 4
TEMPERATURE = 0.8


class Engines:
    """An engine that swaps (keeps KV across swaps) and a fresh one started on version 1's weights."""

    def __init__(self, loop, swapping, fresh, store, model_dirs):
        self.loop, self.swapping, self.fresh, self.store, self.model_dirs = loop, swapping, fresh, store, model_dirs

    def run(self, coroutine):
        return self.loop.run_until_complete(coroutine)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from safetensors.torch import load_file

    from forge_rl.engines.config import GeneratorConfig
    from forge_rl.engines.vllm_engine import VLLMEngine
    from forge_rl.models.tiny import TinyModelConfig, create_tiny_model

    model_dirs = [create_tiny_model(TinyModelConfig(seed=s), tmp_path_factory.mktemp(f"model{s}")) for s in (0, 1, 2)]
    root = Path("/dev/shm") / f"forge_rl-test-engine-store-{time.monotonic_ns()}"
    loop = asyncio.new_event_loop()

    async def build():
        index, _ = await open_store(root, model_dirs[0], keep_latest=1)
        store = WeightStore(index, root, extra_files_dir=model_dirs[0])
        # Held mid-request for each swap test (tests/support/held_engine.py).
        swapping = HoldableEngine(GeneratorConfig(max_new_tokens=NEW_TOKENS, temperature=TEMPERATURE, swap_kv="reuse"))
        fresh = VLLMEngine(GeneratorConfig(max_new_tokens=NEW_TOKENS, temperature=TEMPERATURE))
        await swapping.start(model_dirs[0], MAX_MODEL_LEN)
        await fresh.start(model_dirs[1], MAX_MODEL_LEN)
        await store.publish(1, load_file(str(model_dirs[1] / "model.safetensors")))
        return store, swapping, fresh

    store, swapping, fresh = loop.run_until_complete(build())
    yield Engines(loop, swapping, fresh, store, model_dirs)
    loop.run_until_complete(swapping.shutdown())
    loop.run_until_complete(fresh.shutdown())
    loop.close()
    store.local.destroy()


async def seeded_samples(engine, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """One sample per prompt with a fixed per-request seed: equal weights give equal samples."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    async def one(i: int, prompt: list[int]):
        params = SamplingParams(
            max_tokens=16,
            temperature=TEMPERATURE,
            seed=1000 + i,
            logprobs=0,
            ignore_eos=True,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        final = None
        async for final in engine._running_llm.generate(  # noqa: B007 (the last output is read below)
            engine.prompt(prompt), params, f"seeded-{i}-{time.monotonic_ns()}"
        ):
            pass
        out = final.outputs[0]
        return list(out.token_ids), [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)]

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


PROMPTS = [[1, 4 + i, 5 + (i * 3) % 7, 6] for i in range(8)]


def test_a_staged_in_flight_swap_serves_what_a_fresh_engine_serves(engines):
    from forge_rl.store.loader import PAUSED_S, REQUESTS_OVER_OLDER_KV, STAGE_S, load_version

    async def swap_under_load():
        batch = await start_held_batch(engines.swapping, PROMPTS, 4, HOLD_AFTER_TOKENS)
        metrics = await load_version(engines.swapping, engines.store, 1, "keep", verify=True)
        return metrics, await batch

    metrics, groups = engines.run(swap_under_load())
    print({k: v for k, v in metrics.items() if isinstance(v, float)})
    assert metrics["policy_version"] == 1 and metrics["loader"] == "staged" and metrics["verified"]
    assert metrics[STAGE_S] > 0 and metrics[PAUSED_S] < 1.0
    completions = [c for group in groups for c in group]
    # Held after HOLD_AFTER_TOKENS tokens, every request continued on version 1 from there.
    assert all(
        c.policy_versions == [0] * HOLD_AFTER_TOKENS + [1] * (NEW_TOKENS - HOLD_AFTER_TOKENS) for c in completions
    )
    assert metrics[REQUESTS_OVER_OLDER_KV] > 0  # they continued on KV of version 0 (swap_kv=reuse)

    swapped = engines.run(seeded_samples(engines.swapping, PROMPTS))
    fresh = engines.run(seeded_samples(engines.fresh, PROMPTS))
    for (tokens, logprobs), (fresh_tokens, fresh_logprobs) in zip(swapped, fresh):
        assert tokens == fresh_tokens
        assert logprobs == pytest.approx(fresh_logprobs, abs=1e-5)


def test_drain_lets_requests_finish_on_the_old_weights(engines):
    from safetensors.torch import load_file

    from forge_rl.store.loader import REQUESTS_OVER_OLDER_KV, load_version

    async def swap_under_load():
        await engines.store.publish(2, load_file(str(engines.model_dirs[2] / "model.safetensors")))
        batch = await start_held_batch(engines.swapping, PROMPTS, 2, HOLD_AFTER_TOKENS)
        metrics = await load_version(engines.swapping, engines.store, 2, "wait")
        return metrics, await batch

    metrics, groups = engines.run(swap_under_load())
    assert metrics["policy_version"] == 2
    assert all(set(c.policy_versions) == {1} for group in groups for c in group)
    assert metrics[REQUESTS_OVER_OLDER_KV] == 0  # nothing continued across the swap


def test_abort_and_resubmit_keeps_every_completion_whole(engines):
    from safetensors.torch import load_file

    from forge_rl.store.loader import load_version

    async def swap_under_load():
        await engines.store.publish(3, load_file(str(engines.model_dirs[1] / "model.safetensors")))
        batch = await start_held_batch(engines.swapping, PROMPTS, 2, HOLD_AFTER_TOKENS)
        metrics = await load_version(engines.swapping, engines.store, 3, "abort")
        return metrics, await batch

    metrics, groups = engines.run(swap_under_load())
    completions = [c for group in groups for c in group]
    assert metrics["policy_version"] == 3
    # Every request was aborted after HOLD_AFTER_TOKENS tokens and resubmitted: whole, old then new.
    assert all(
        c.policy_versions == [2] * HOLD_AFTER_TOKENS + [3] * (NEW_TOKENS - HOLD_AFTER_TOKENS) for c in completions
    )
    # Served weights are version 1's again (version 3 = model 1): a fresh engine agrees.
    swapped = engines.run(seeded_samples(engines.swapping, PROMPTS))
    fresh = engines.run(seeded_samples(engines.fresh, PROMPTS))
    assert [t for t, _ in swapped] == [t for t, _ in fresh]


def test_a_staged_swap_after_a_stock_reload_loads_every_module(engines):
    """vLLM's reload re-wraps the recorded weight loaders; staging must still fill every parameter."""
    from safetensors.torch import load_file

    from forge_rl.store.loader import load_version

    async def reload_then_stage():
        await engines.store.publish(4, load_file(str(engines.model_dirs[2] / "model.safetensors")))
        reload = await load_version(engines.swapping, engines.store, 4, "keep", loader="reload")
        await engines.store.publish(5, load_file(str(engines.model_dirs[1] / "model.safetensors")))
        staged = await load_version(engines.swapping, engines.store, 5, "keep", verify=True)
        return reload, staged

    reload, staged = engines.run(reload_then_stage())
    assert (reload["loader"], staged["loader"]) == ("reload", "staged")
    swapped = engines.run(seeded_samples(engines.swapping, PROMPTS))
    fresh = engines.run(seeded_samples(engines.fresh, PROMPTS))
    for (tokens, logprobs), (fresh_tokens, fresh_logprobs) in zip(swapped, fresh):
        assert tokens == fresh_tokens
        assert logprobs == pytest.approx(fresh_logprobs, abs=1e-5)
