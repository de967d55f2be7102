"""The service's backend on the meshes: the trainer mesh holding every tenant's adapters
(`forge_rl.actors.service_trainer`), the generator pool serving them (vLLM multi-LoRA), the
weight store between them.

How a tenant's weights reach a sampler: `save_for_sampler` publishes the tenant's adapters as the
next version of the weight store (versions count saves over all tenants, so every adapter a
generator holds has a name of its own); the path handed back names that version. A sample of it
runs on that adapter exactly, loaded from the store by the generator that takes the request if it
does not hold it (`forge_rl.actors.generator.GeneratorActor.sample`). An "inflight" save moves the tenant's
inflight path to the new version: samples of that path from then on use it.

Calls on one training model are carried out in the order they were made (each model's lock);
calls of different models reach the trainer mesh, whose plain endpoints serialize them, without
waiting for each other here. Each optimizer step appends the tenant's figures to
<service dir>/tenants/<model id>/metrics.jsonl (and its TensorBoard or W&B, with --log.*).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from forge_rl.actors.generator_pool import GeneratorPool
from forge_rl.actors.service_trainer import ServiceTrainerActor
from forge_rl.errors import generator_lost, raised_by_actor
from forge_rl.models.lora_config import ATTENTION_TARGETS, MLP_TARGETS, UNEMBED_TARGETS
from forge_rl.models.parallel import read_hf_config
from forge_rl.observability.metrics import progress
from forge_rl.observability.sinks import open_sinks
from forge_rl.service.backend import (
    AdamStep,
    ForwardBackwardResult,
    LoraSpec,
    RequestRefused,
    SampleResult,
    SampleSpec,
    SavedWeights,
    TrainingDatum,
)
from forge_rl.service.config import ServeConfig
from forge_rl.store.actors import StoreIndexActor, spawn_store
from forge_rl.tasks.tokenizer import PromptTokenizer

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
"""A saved weights' name: it becomes a path component."""


@dataclass
class _Tenant:
    model_id: str
    lora: LoraSpec
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    sampler_paths: dict[str, int] = field(default_factory=dict)
    """tinker:// sampler path -> weight store version."""
    num_steps: int = 0
    tokens_since_step: int = 0
    loss_since_step: float = 0.0
    sinks: list = field(default_factory=list)
    """TensorBoard / W&B, as --log.tensorboard and --log.wandb ask (under the tenant's directory)."""
    last_progress: float = float("-inf")


class MeshBackend:
    """`ServiceBackend` on spawned meshes; built by `spawn`, started by `start`."""

    def __init__(
        self, config: ServeConfig, trainer, generators, store_index: StoreIndexActor, service_dir: Path, model_dir: Path
    ) -> None:
        self.config = config
        self.trainer = trainer
        self.generators = generators
        self.store_index = store_index
        self.service_dir = service_dir
        self.base_model = config.served_name
        hf_config = read_hf_config(model_dir)
        self.max_context_length = hf_config["max_position_embeddings"]  # the run's max_model_len
        self.vocab_size = hf_config["vocab_size"]
        self.tokenizer_id = str(Path(model_dir).resolve())
        """What the SDK's get_tokenizer loads (transformers' AutoTokenizer): the model directory."""
        self.eos_id = PromptTokenizer(model_dir).eos_id
        self._tenants: dict[str, _Tenant] = {}
        self._model_ids = itertools.count()
        self._versions = itertools.count(1)
        self._next_generator = itertools.cycle(range(config.num_generators))
        self._states: dict[str, Path] = {}
        """tinker:// state path -> its checkpoint directory."""

    @classmethod
    async def spawn(cls, config: ServeConfig, hosts, lifecycle) -> MeshBackend:
        """The service's processes on `hosts` (`forge_rl.run.launch`): the services process (the
        store's index and volume, the generator pool) and the trainer ranks."""
        run = lifecycle.config  # the run these meshes are (ServeConfig.run_config)
        model_dir, store_root = str(lifecycle.model_dir), str(lifecycle.store.root)
        services = hosts.spawn_services()
        trainer_procs = await hosts.spawn_ranks("trainer", config.trainer.num_procs)
        store_index, _ = await spawn_store(
            services,
            lifecycle.store.root,
            extra_files_dir=model_dir,
            keep_latest=config.versions_kept,
            volume_procs=hosts.store_volume_procs(services),
        )
        generators = services.spawn(
            "generators",
            GeneratorPool,
            config.generator,
            model_dir,
            run.max_model_len,
            config.num_generators,
            store_index,
            hosts.generator_placements(),
            run.generate_timeout_s,
            run.update_timeout_s,
            adapters=config.adapter_serving(model_dir),
            store_root=store_root,
        )
        trainer = trainer_procs.spawn(
            "service_trainer",
            ServiceTrainerActor,
            config.trainer,
            model_dir,
            store_index,
            store_root,
            config.publish,
            config.launch.placement.trainer_cpus,
        )
        lifecycle.stop_engines_first(generators)
        return cls(config, trainer, generators, store_index, lifecycle.run_path, lifecycle.model_dir)

    async def start(self) -> dict:
        """Start every engine and trainer rank at once; returns their start figures."""
        generator_starts, trainer_starts = await asyncio.gather(
            self.generators.start.call_one(), self.trainer.setup.call()
        )
        processes = {
            "generators": await self.generators.processes.call_one(),
            "trainer": [start["pid"] for start in trainer_starts.values()],
        }
        (self.service_dir / "processes.json").write_text(json.dumps(processes))
        return {
            "engine_start_s": max(start["engine_start_s"] for start in generator_starts),
            "trainer_setup_s": max(start["trainer_setup_s"] for start in trainer_starts.values()),
        }

    # Training models -------------------------------------------------------------------------

    async def create_model(self, lora: LoraSpec) -> str:
        served = self.config.trainer.lora.rank
        if lora.rank != served:
            raise RequestRefused(
                f"lora_config.rank ({lora.rank}) differs from the rank this server trains ({served}): every tenant's "
                f"adapter has the server's rank. Create the training client with rank={served}, or restart "
                f"`forge-rl serve` with --trainer.lora.rank {lora.rank}."
            )
        frozen = self._frozen_targets(lora)
        model_id = f"model-{next(self._model_ids)}"
        seed = lora.seed if lora.seed is not None else len(self._tenants)
        await self._on_trainer("add_tenant", model_id, seed, frozen)
        directory = self.service_dir / "tenants" / model_id
        directory.mkdir(parents=True, exist_ok=True)
        sinks = open_sinks(self.config.log, directory, {"model_id": model_id, "lora_rank": lora.rank, "seed": seed})
        self._tenants[model_id] = _Tenant(model_id, lora, sinks=sinks)
        return model_id

    def _frozen_targets(self, lora: LoraSpec) -> tuple[str, ...]:
        """The served targets this tenant leaves untrained; RequestRefused for a kind of layer it
        asks to train that the server does not adapt."""
        served = set(self.config.trainer.lora.targets)
        kinds = {"train_attn": ATTENTION_TARGETS, "train_mlp": MLP_TARGETS, "train_unembed": UNEMBED_TARGETS}
        frozen = []
        for flag, targets in kinds.items():
            if getattr(lora, flag):
                missing = [t for t in targets if t not in served]
                if missing:
                    raise RequestRefused(
                        f"lora_config.{flag} is true, but this server does not adapt {missing} (its "
                        f"--trainer.lora.targets: {sorted(served)}). Set {flag}=False, or restart `forge-rl serve` "
                        f"with those layers in --trainer.lora.targets."
                    )
            else:
                frozen += [t for t in targets if t in served]
        return tuple(frozen)

    def model_info(self, model_id: str) -> LoraSpec:
        return self._tenant(model_id).lora

    async def unload_model(self, model_id: str) -> None:
        tenant = self._tenant(model_id)
        async with tenant.lock:
            await self._on_trainer("remove_tenant", model_id)
            del self._tenants[model_id]
        for sink in tenant.sinks:
            sink.close()

    async def forward_backward(
        self,
        model_id: str,
        data: list[TrainingDatum],
        loss_fn: str,
        loss_fn_config: dict[str, float] | None,
        backward: bool,
    ) -> ForwardBackwardResult:
        tenant = self._tenant(model_id)
        for index, datum in enumerate(data):
            self._check_vocabulary(datum.tokens, f"data[{index}].model_input")
        wire = [(datum.tokens, datum.inputs) for datum in data]
        async with tenant.lock:
            outputs, metrics = await self._on_trainer(
                "forward_backward", model_id, wire, loss_fn, loss_fn_config, backward
            )
            if backward:
                tenant.tokens_since_step += sum(len(datum.tokens) for datum in data)
                tenant.loss_since_step += metrics["loss:sum"]
        return ForwardBackwardResult(outputs, metrics)

    async def optim_step(self, model_id: str, step: AdamStep) -> dict[str, float]:
        tenant = self._tenant(model_id)
        if not (step.learning_rate >= 0 and 0 <= step.beta1 < 1 and 0 <= step.beta2 < 1 and step.eps > 0):
            raise RequestRefused(
                f"adam_params {step} out of range: learning_rate >= 0, beta1 and beta2 in [0, 1), eps > 0."
            )
        async with tenant.lock:
            metrics = await self._on_trainer("optim_step", model_id, step.__dict__)
            tenant.num_steps += 1
            record = {
                "step": tenant.num_steps,
                "time": time.time(),
                "tokens": tenant.tokens_since_step,
                "loss_sum": tenant.loss_since_step,
                "learning_rate": step.learning_rate,
                **metrics,
            }
            tenant.tokens_since_step, tenant.loss_since_step = 0, 0.0
        self._log(tenant, record)
        return metrics

    def _log(self, tenant: _Tenant, record: dict) -> None:
        """The step's record to the tenant's metrics.jsonl and sinks, and a progress line at most
        every log.progress_every_s per tenant."""
        with (self.service_dir / "tenants" / tenant.model_id / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")
        for sink in list(tenant.sinks):
            try:
                sink.log(record["step"], record)
            except Exception as e:  # a dashboard outage must not cost the tenant its step
                progress(f"{tenant.model_id}: metrics sink {type(sink).__name__} failed and is turned off: {e}")
                tenant.sinks.remove(sink)
        now = time.monotonic()
        if now - tenant.last_progress >= self.config.log.progress_every_s:
            tenant.last_progress = now
            progress(
                f"{tenant.model_id} step {record['step']} | loss {record['loss_sum']:.4g} | grad norm "
                f"{record['grad_norm']:.3g} | {record['tokens']} tokens"
            )

    def close(self) -> None:
        """Close every tenant's sinks (the service is stopping)."""
        for tenant in self._tenants.values():
            for sink in tenant.sinks:
                sink.close()

    async def save_for_sampler(
        self, model_id: str, name: str | None, kind: Literal["snapshot", "inflight"]
    ) -> SavedWeights:
        tenant = self._tenant(model_id)
        async with tenant.lock:
            version = next(self._versions)
            await self._on_trainer("publish", model_id, version)
            # The write runs in the background on rank 0; a sample of the path may come the moment
            # it is answered (the cookbook's loops sample at once), so answer once it is complete.
            await self._on_trainer("wait_for_publish")
        if kind == "inflight":
            path = f"tinker://{model_id}/sampler_weights/inflight"
        else:
            path = f"tinker://{model_id}/sampler_weights/{self._name(name, f'v{version}')}"
        tenant.sampler_paths[path] = version
        return SavedWeights(path, version)

    async def save_state(self, model_id: str, name: str) -> SavedWeights:
        tenant = self._tenant(model_id)
        name = self._name(name, f"step-{tenant.num_steps}")
        directory = self.service_dir / "tenants" / model_id / "states" / name
        async with tenant.lock:
            await self._on_trainer("save_state", model_id, str(directory))
        path = f"tinker://{model_id}/weights/{name}"
        self._states[path] = directory
        return SavedWeights(path, tenant.num_steps)

    async def load_state(self, model_id: str, path: str, with_optimizer: bool) -> None:
        tenant = self._tenant(model_id)
        directory = self._states.get(path)
        if directory is None:
            raise RequestRefused(
                f"path {path!r} names no state saved on this server (its states: {sorted(self._states) or 'none'}). "
                "Pass a path save_state returned.",
                status=404,
            )
        async with tenant.lock:
            await self._on_trainer("load_state", model_id, str(directory), with_optimizer)

    # Sampling --------------------------------------------------------------------------------

    async def sample(self, model_path: str | None, spec: SampleSpec) -> SampleResult:
        version = None if model_path is None else self._sampler_version(model_path)
        self._check_vocabulary(spec.prompt, "prompt")
        for attempt in range(self.config.num_generators + 1):
            index = next(self._next_generator)
            try:
                return await self.generators.sample.call_one(index, spec.prompt, spec, version)
            except Exception as e:
                if generator_lost(e) is None or attempt == self.config.num_generators:
                    raise _refused_or_raised(e) from e
                # Its generator died: the pool replaces it; the request is sampled again on the
                # replacement (which loads the adapter from the store) or on the next generator.
                progress(f"generator {index} was lost during a sample ({generator_lost(e)}); sampling again")
                await self.generators.wait_until_serving.call_one(index)
        raise AssertionError("unreachable")

    def _sampler_version(self, model_path: str) -> int:
        for tenant in self._tenants.values():
            if model_path in tenant.sampler_paths:
                return tenant.sampler_paths[model_path]
        known = sorted(path for tenant in self._tenants.values() for path in tenant.sampler_paths)
        raise RequestRefused(
            f"model_path {model_path!r} names no sampler weights of this server (saved: {known or 'none'}). "
            "Pass a path save_weights_for_sampler returned, or sample the base model.",
            status=404,
        )

    # Helpers ---------------------------------------------------------------------------------

    def _tenant(self, model_id: str) -> _Tenant:
        tenant = self._tenants.get(model_id)
        if tenant is None:
            raise RequestRefused(
                f"model_id {model_id!r} is no training model of this server (its models: {sorted(self._tenants) or 'none'}). "
                "Create one with create_lora_training_client.",
                status=404,
            )
        return tenant

    def _check_vocabulary(self, tokens: list[int], where: str) -> None:
        """Token ids the model has. The face has checked the rest of a request's shape (empty,
        negative ids, the context, num_samples, the loss: `forge_rl.service.wire`); the vocabulary
        is the model's, known here."""
        bad = next((token for token in tokens if not 0 <= token < self.vocab_size), None)
        if bad is not None:
            raise RequestRefused(
                f"{where} holds token id {bad}, outside the model's vocabulary [0, {self.vocab_size}). Encode with "
                "the base model's tokenizer (training_client.get_tokenizer())."
            )

    @staticmethod
    def _name(name: str | None, default: str) -> str:
        if name is None:
            return default
        if not _NAME.match(name):
            raise RequestRefused(
                f"name {name!r} must be 1-128 letters, digits, '_', '.' or '-' (it becomes a path component)."
            )
        return name

    async def _on_trainer(self, endpoint: str, *args):
        """Every trainer rank's `endpoint` (a collective); rank 0's answer. A ValueError the
        trainer raised (a datum without an input, a checkpoint that does not fit) is the
        request's fault: RequestRefused with its message."""
        try:
            answers = await getattr(self.trainer, endpoint).call(*args)
        except Exception as e:
            raise _refused_or_raised(e) from e
        return next(iter(answers.values()))


def _refused_or_raised(error: Exception) -> Exception:
    raised = raised_by_actor(error)
    if isinstance(raised, RequestRefused):
        return raised
    if type(raised) is ValueError:
        return RequestRefused(str(raised))
    return error
