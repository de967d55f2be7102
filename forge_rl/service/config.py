"""`forge-rl serve`'s configuration: the base model and its meshes (as a run's), the HTTP face.

The meshes are configured as a GRPO run's are (model, trainer, generator, launch, publish: the
same sections and flags), so that what runs a recipe runs the service; `run_config` is that run's
config, from which the lifecycle (run directory, weight store, shutdown) and the launch (hosts,
processes) work unchanged. The trainer always trains LoRA adapters, one per tenant, on the frozen
base: trainer.lora.rank is the rank every tenant's adapter has.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import time
from dataclasses import dataclass, field
from pathlib import Path

from forge_rl.config import GRPOConfig, LogConfig, ModelConfig
from forge_rl.engines.adapters import AdapterServing
from forge_rl.engines.config import GeneratorConfig
from forge_rl.errors import ConfigError
from forge_rl.models.lora_config import ATTENTION_TARGETS, MLP_TARGETS, UNEMBED_TARGETS, LoRAConfig
from forge_rl.plumbing.placement import LaunchConfig
from forge_rl.plumbing.threads import with_chosen_threads
from forge_rl.store.publisher import PublishConfig
from forge_rl.training.trainer_config import TrainerConfig

LOOPBACK = "127.0.0.1"


def _service_trainer() -> TrainerConfig:
    # The tinker cookbook's default rank (its recipes create rank-32 training clients), on every
    # layer kind a Tinker LoRA config may train (its train_attn, train_mlp, train_unembed: all on
    # by default); each tenant trains the kinds its config asks for.
    targets = ATTENTION_TARGETS + MLP_TARGETS + UNEMBED_TARGETS
    return TrainerConfig(lora=LoRAConfig(enabled=True, rank=32, alpha=32.0, targets=targets))


@dataclass(frozen=True)
class ServeConfig:
    """Serve the Tinker API over the meshes of one base model: train LoRA tenants, sample them."""

    config: Path | None = None
    """A YAML file with any of these fields (flags given on the command line win)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The base model every tenant adapts (model.path: an HF directory; unset: a tiny model built here)."""
    base_model: str | None = None
    """The name clients pass as base_model (e.g. "HuggingFaceTB/SmolLM2-135M-Instruct"); unset: the
    model directory's name. Any other name is refused, naming this one."""
    trainer: TrainerConfig = field(default_factory=_service_trainer)
    """The trainer mesh (trainer.lora.rank: every tenant's adapter rank; trainer.lora.targets: the
    layers tenants may adapt, by default attention, MLP and the unembedding; lora.enabled is
    always on)."""
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    """The vLLM engines (KV cache, threads, eager mode); sampling parameters come with each request."""
    num_generators: int = 1
    """vLLM engines serving every tenant's adapters; a request goes to the next in turn."""
    adapters_resident: int = 8
    """Adapters each engine keeps loaded (vLLM's max_loras is one more); a sample of another is
    loaded again from the weight store first."""
    versions_kept: int = 64
    """Saved sampler weights the weight store keeps; a sample of an older one is refused, naming
    the fix (save the weights again)."""
    host: str = LOOPBACK
    """The address the HTTP server binds; anything but loopback needs --api-key."""
    port: int = 8000
    """0: any free port (printed)."""
    api_key: str | None = None
    """When set, every request must carry it (the SDK's api_key / TINKER_API_KEY)."""
    max_request_mb: float = 64.0
    """Largest request body accepted (413 past it)."""
    run_dir: Path = Path("runs")
    run_name: str | None = None
    """The service's directory under run_dir (metrics per tenant, saved states); unset: serve-<time>."""
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    publish: PublishConfig = field(default_factory=PublishConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self) -> None:
        if not self.trainer.lora.enabled:
            object.__setattr__(
                self,
                "trainer",
                dataclasses.replace(self.trainer, lora=dataclasses.replace(self.trainer.lora, enabled=True)),
            )
        trainer, generator = with_chosen_threads(
            self.trainer,
            self.generator,
            trainer_procs=self.trainer.num_procs,
            generators=self.num_generators,
            trainer_cpus=self.launch.placement.trainer_cpus,
            generator_cpus=self.launch.placement.generator_cpus,
            hosts=self.launch.hosts,
        )
        object.__setattr__(self, "trainer", trainer)
        object.__setattr__(self, "generator", generator)
        checks = [
            ("num_generators", self.num_generators >= 1, ">= 1"),
            ("adapters_resident", self.adapters_resident >= 1, ">= 1"),
            ("versions_kept", self.versions_kept >= 1, ">= 1"),
            ("port", 0 <= self.port <= 65535, "between 0 and 65535"),
            ("max_request_mb", self.max_request_mb > 0, "> 0"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ConfigError(f"{name} ({getattr(self, name)}) must be {rule}. Set --{name.replace('_', '-')}.")
        if not _is_loopback(self.host) and not self.api_key:
            raise ConfigError(
                f"--host {self.host} serves beyond this machine, and without --api-key anyone who reaches it could "
                "train and sample: set --api-key (clients pass it as api_key, or TINKER_API_KEY), or keep the "
                f"default --host {LOOPBACK}."
            )

    @property
    def served_name(self) -> str:
        if self.base_model is not None:
            return self.base_model
        return self.model.path.name if self.model.path is not None else "forge-rl/tiny"

    def run_config(self) -> GRPOConfig:
        """The run these meshes are: what the lifecycle and the launch read."""
        return GRPOConfig(
            model=self.model,
            trainer=self.trainer,
            generator=self.generator,
            num_generators=self.num_generators,
            run_dir=self.run_dir,
            run_name=self.run_name or time.strftime("serve-%Y%m%d-%H%M%S"),
            launch=self.launch,
            publish=self.publish,
            log=self.log,
            # One group of two completions: the recipe's batch rules hold; the service has no batches.
            train_batch_size=2,
            group_size=2,
        )

    def adapter_serving(self, model_dir: str) -> AdapterServing:
        return AdapterServing(self.trainer.lora.rank, self.adapters_resident, str(Path(model_dir)))


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
