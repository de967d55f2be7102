"""The policy trainer: one optimizer step of the policy loss per `TrainBatch` on a TorchTitan llama3 model.

One `PolicyTrainer` runs in each trainer process (rank). Every rank receives the whole batch and
keeps its data-parallel shard; tensor-parallel ranks of one data-parallel group share rows. No
Monarch here: a launcher (a Monarch actor, or torch.multiprocessing in the tests) sets
RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT and constructs one `PolicyTrainer` per process.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from forge_rl.core.batching import TrainBatch
from forge_rl.models.lora import LoRAAdapters
from forge_rl.models.titan import build_titan_model, export_hf_state_dict, init_process_group_from_env, reshard
from forge_rl.observability.metric_names import (
    MISMATCH_KL_BY_GENERATOR,
    MISMATCH_KL_FRESH_BY_GENERATOR,
    POLICY_ENTROPY,
    TRAINER_BACKWARD_S,
    TRAINER_FORWARD_S,
    TRAINER_OPTIMIZER_S,
)
from forge_rl.routing import keep_routing_metrics
from forge_rl.training.losses.corrections import k3_kl_NL
from forge_rl.training.losses.policy import num_loss_units, policy_loss, token_mean
from forge_rl.training.packing import layout_token_logprobs, plan_microbatches, plan_prefix_tree, tree_token_logprobs
from forge_rl.training.trainer_config import TrainerConfig

_ADAPTERS = "adapters"
"""The checkpoint section of a LoRA run's adapters (a full run's weights are under "model")."""


def _select_device() -> torch.device:
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


class PolicyTrainer:
    """Holds this rank's model shard and optimizer; `policy_version` counts optimizer steps.

    A batch whose loss or global gradient norm is not finite is skipped: no optimizer step, so the
    weights, the AdamW moments and `policy_version` stay as they were, and the metrics say
    `step_skipped: 1`. Both values are reduced over all ranks first, so every rank skips together
    and no collective is left half-joined. `trainer.max_consecutive_nonfinite_steps` skips in a row
    raise FloatingPointError: by then the weights themselves are likely broken, or every batch is.
    """

    def __init__(self, config: TrainerConfig, model_dir: Path | str) -> None:
        torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        self.config = config
        self.device = _select_device()
        self.rank, world_size = init_process_group_from_env(self.device)
        if world_size != config.num_procs:
            raise ValueError(
                f"trainer.num_procs ({config.num_procs}) differs from WORLD_SIZE ({world_size}) set by the "
                "launcher. Launch trainer.num_procs processes, or set --trainer.num-procs."
            )
        self.model, parallel_dims = build_titan_model(
            model_dir, config.parallel, self.device, config.activation_checkpointing, config.mixed_precision
        )
        # One process has no FSDP2 MixedPrecisionPolicy; bf16 compute comes from autocast instead.
        self._autocast_bf16 = config.mixed_precision == "bf16" and world_size == 1
        # "batch" is TorchTitan's data-parallel mesh axis (dp_replicate x dp_shard): ranks on it get
        # different rows.
        self._dp_group = parallel_dims.get_mesh("batch").get_group() if parallel_dims.dp_enabled else None
        self._dp_rank = dist.get_rank(self._dp_group) if self._dp_group is not None else 0
        self._dp_size = config.parallel.dp_degree
        # Sequence parallelism splits positions over TP ranks, so lengths are padded to a multiple.
        self._length_multiple = config.parallel.tp
        # LoRA: adapters built on the parallelized model, split as their layers are; the base frozen.
        self.lora = LoRAAdapters(self.model, config.lora, seed=config.seed) if config.lora.enabled else None
        if self.lora is not None:
            self.lora.attach()
        self.optimizer = torch.optim.AdamW(
            self._trainable_parameters(),
            lr=config.lr,
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
            foreach=True,
        )
        self.policy_version = 0
        self.num_consecutive_nonfinite_steps = 0
        self._checkpoint_write: concurrent.futures.Future | None = None
        """The write of the newest checkpoint (`start_checkpoint`), until waited for."""
        self._checkpoint_group = None
        """The gloo group the checkpoint writes' collectives run on, made at the first one."""
        self._routing_shape = self._keep_routing_shape(model_dir) if config.keep_routing else None

    def _keep_routing_shape(self, model_dir: Path | str):
        """The routing record this model takes; ValueError on a dense model."""
        from forge_rl.models.moe import routing_shape
        from forge_rl.models.titan import read_hf_config

        hf_config = read_hf_config(model_dir)
        if "num_experts_per_tok" not in hf_config:
            raise ValueError(
                f"trainer.keep_routing is on but {model_dir} is a dense model ({hf_config.get('architectures')}): "
                "there is no routing to keep. Set --trainer.no-keep-routing."
            )
        return routing_shape(hf_config)

    def _trainable_parameters(self) -> list[torch.nn.Parameter]:
        """What the optimizer steps: the adapters with LoRA, else every weight of the model."""
        return list((self.lora if self.lora is not None else self.model).parameters())

    def _logits(
        self,
        input_ids_NL: torch.Tensor,
        positions_NL: torch.Tensor | None = None,
        mask_N1LL: torch.Tensor | None = None,
        replay: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """[N, L, V] fp32 logits; under TP the vocab-sharded output is gathered (differentiably).

        Without `positions_NL`/`mask_N1LL` each row is one causal sequence; with them (a packed
        row, `forge_rl.training.packing.document_mask`) attention stays within each sequence. `replay`
        (expert ids [N, L, X, K], has-record [N, L]) pins the MoE routing (trainer.keep_routing).
        """
        length = input_ids_NL.shape[1]
        padding = -length % self._length_multiple
        if padding:  # the packing layouts are already multiples
            # Right padding cannot change earlier positions under causal attention; it is cut off again.
            assert positions_NL is None and mask_N1LL is None
            input_ids_NL = torch.nn.functional.pad(input_ids_NL, (0, padding))
        positions_NL = None if positions_NL is None else positions_NL.to(self.device)
        replaying: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        if replay is not None:
            from forge_rl.models.moe import routing_replay

            replaying = routing_replay(self.model, *replay)
        with replaying, torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self._autocast_bf16):
            logits_NLV = self.model(input_ids_NL.to(self.device), positions=positions_NL, attention_masks=mask_N1LL)
        if isinstance(logits_NLV, DTensor):
            logits_NLV = logits_NLV.full_tensor()
        return logits_NLV[:, :length].float()

    def _token_logprobs(self, shard: TrainBatch) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """[N, L] logprobs of the shard's tokens through the `trainer.batching` layout, under the
        distribution the generator sampled from (temperature, top-k/top-p kept sets), [N, L] the
        policy's entropy there, and this rank's token counts: the sequences' tokens, those the
        forward computed (fewer than the sequences' in a prefix tree, which computes a shared
        prefix once) and its slots (computed + padding)."""
        lengths = shard.row_lengths
        entropy_NL = torch.zeros(shard.input_ids_NL.shape, device=self.device)
        if self.config.batching == "tree":
            tree = plan_prefix_tree(
                shard.input_ids_NL, lengths, shard.temperature_N, shard.support_NLK, self._length_multiple
            )
            logprobs_NL = tree_token_logprobs(
                self._logits, shard.input_ids_NL, lengths, tree, shard.temperature_N, shard.support_NLK, entropy_NL
            )
            counts = {
                "input_tokens": float(sum(lengths)),
                "computed": float(tree.num_computed),
                "slots": float(tree.num_slots),
            }
            return logprobs_NL, entropy_NL, counts
        microbatches = plan_microbatches(
            lengths, self.config.batching, self._length_multiple, width=shard.input_ids_NL.shape[1]
        )
        logprobs_NL = layout_token_logprobs(
            self._logits,
            shard.input_ids_NL,
            lengths,
            microbatches,
            shard.temperature_N,
            shard.support_NLK,
            entropy_NL,
            routing=self._replayed_routing(shard),
        )
        counts = {
            "input_tokens": float(sum(lengths)),
            "computed": float(sum(lengths)),
            "slots": float(sum(m.num_slots for m in microbatches)),
        }
        return logprobs_NL, entropy_NL, counts

    def _replayed_routing(self, shard: TrainBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The shard's routing records to replay (trainer.keep_routing), checked against the model."""
        if self._routing_shape is None or shard.routed_experts_NLXK is None:
            return None
        self._routing_shape.check(shard.routed_experts_NLXK, "trainer.keep_routing")
        return shard.routed_experts_NLXK, shard.routed_NL

    def _keep_routing_metrics(self, batch: TrainBatch) -> dict[str, float]:
        """Record coverage of the batch, and over the step's replayed (token, MoE layer) pairs the
        fraction whose recorded experts differ from the trainer's own choice: the routing mismatch
        Keep Routing removed (`keep_routing/overridden_fraction`)."""
        from forge_rl.models.moe import take_replay_counts

        replayed, overridden = self._dp_reduce(list(take_replay_counts(self.model)), dist.ReduceOp.SUM)
        return keep_routing_metrics(batch) | {"keep_routing/overridden_fraction": overridden / max(replayed, 1.0)}

    def _dp_reduce(self, values: list[float], op: dist.ReduceOp.RedOpType) -> list[float]:
        """Element-wise reduction over data-parallel ranks (identity on one rank)."""
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self._dp_group is not None and values:
            dist.all_reduce(tensor, op=op, group=self._dp_group)
        return tensor.tolist()

    def _global_metrics(self, loss: torch.Tensor, loss_metrics: dict[str, float], share: float) -> dict:
        """Batch-wide loss and loss metrics: token means add up weighted by each shard's token share,
        maxima ("/max_" in the name) reduce by max."""
        maxima = {name: value for name, value in loss_metrics.items() if "/max_" in name}
        means = {name: value * share for name, value in loss_metrics.items() if name not in maxima}
        totals = self._dp_reduce([loss.item(), *means.values()], dist.ReduceOp.SUM)
        metrics = {"loss": totals[0], **dict(zip(means, totals[1:]))}
        metrics.update(zip(maxima, self._dp_reduce(list(maxima.values()), dist.ReduceOp.MAX)))
        return metrics

    def _mismatch_by_generator(
        self,
        batch: TrainBatch,
        shard: TrainBatch,
        logprobs_NL: torch.Tensor,
        behaviour_NL: torch.Tensor,
        loss_mask_NL: torch.Tensor,
    ) -> dict[str, float]:
        """Trainer-vs-sampler mismatch KL (k3, token mean) of each generator's completions in the
        batch: over all their trained tokens, `mismatch_kl/generator/<i>` (policy lag included: a
        token one version old was sampled by weights the trainer no longer holds), and over those
        whose weights and KV were all the trainer's version (`TrainBatch.exact_version_NL`),
        `mismatch_kl_fresh/generator/<i>` (absent when a generator has none). Only the fresh KL
        compares a generator's weights with what its version labels say, so a generator serving
        other weights stands out there long before the reward shows it (`forge_rl.observability.health`)."""
        generators = sorted({g for g in batch.generator_N.tolist() if g >= 0}) if batch.generator_N is not None else []
        if not generators:
            return {}
        kl_NL = k3_kl_NL(torch.where(loss_mask_NL, logprobs_NL.detach() - behaviour_NL, 0.0).clamp(-20, 20))
        assert shard.generator_N is not None  # a shard of `batch`, which has it
        owner_N = shard.generator_N.to(self.device)
        exact_NL = torch.ones_like(loss_mask_NL)
        if shard.exact_version_NL is not None:
            exact_NL = shard.exact_version_NL.to(self.device) == self.policy_version
        masks = {}
        for generator in generators:
            owned_NL = loss_mask_NL & (owner_N == generator).unsqueeze(-1)
            masks[f"{MISMATCH_KL_BY_GENERATOR}/{generator}"] = owned_NL
            masks[f"{MISMATCH_KL_FRESH_BY_GENERATOR}/{generator}"] = owned_NL & exact_NL
        sums = [torch.where(mask_NL, kl_NL, 0.0).sum().item() for mask_NL in masks.values()]
        counts = [float(mask_NL.sum().item()) for mask_NL in masks.values()]
        totals = self._dp_reduce(sums + counts, dist.ReduceOp.SUM)
        return {
            name: total / max(count, 1.0)
            for name, total, count in zip(masks, totals[: len(masks)], totals[len(masks) :])
            if count or name.startswith(MISMATCH_KL_BY_GENERATOR + "/")  # no exact tokens: no fresh KL
        }

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One AdamW step on the policy loss of `batch` (the full batch, identical on every rank).

        Returns batch-wide metrics, identical on every rank (see `_global_metrics`), with
        `step_skipped` 1 when the loss or gradient norm was not finite and the step was skipped (see
        the class docstring); raises FloatingPointError after too many such steps in a row.
        """
        start = time.perf_counter()
        shard = batch.shard(self._dp_rank, self._dp_size)
        global_tokens = max(batch.num_generated_tokens, 1)
        local_tokens = shard.num_generated_tokens
        logprobs_NL, entropy_NL, layout_counts = self._token_logprobs(shard)
        reference_NL = shard.reference_logprobs_NL
        behaviour_NL, loss_mask_NL = shard.behaviour_logprobs_NL.to(self.device), shard.loss_mask_NL.to(self.device)
        local_loss, loss_metrics = policy_loss(
            logprobs_NL,
            behaviour_NL,
            shard.advantages_NL.to(self.device),
            loss_mask_NL,
            self.config.loss,
            None if reference_NL is None else reference_NL.to(self.device),
        )
        loss_metrics[POLICY_ENTROPY] = token_mean(entropy_NL, loss_mask_NL)
        # policy_loss is this shard's mean over its loss units (tokens, or sequences for gspo and
        # dr_grpo); reweighted by the shard's share of the batch's units, the per-rank gradients sum
        # (FSDP2 runs without division) to the gradient of the whole batch's loss. Metrics are token
        # means, so they are reweighted by the token share.
        global_units = max(num_loss_units(batch.loss_mask_NL, self.config.loss), 1)
        loss = local_loss * (num_loss_units(shard.loss_mask_NL, self.config.loss) / global_units)
        share = local_tokens / global_tokens
        # Reduced before backward, so every rank sees the same value and skips together.
        metrics = self._global_metrics(loss, loss_metrics, share)
        metrics.update(self._mismatch_by_generator(batch, shard, logprobs_NL, behaviour_NL, loss_mask_NL))
        # Real generated tokens (the loss's tokens); padding is never counted.
        metrics["num_tokens"] = float(batch.num_generated_tokens)
        metrics.update(self._layout_metrics(layout_counts))
        if self._routing_shape is not None:
            metrics.update(self._keep_routing_metrics(batch))
        # The step's phases on this rank (rank 0's reach the log): the trainer's compute, which the
        # loop's overhead breakdown subtracts from the step's critical path (`forge_rl.run.loop`).
        backward_start = time.perf_counter()
        metrics[TRAINER_FORWARD_S] = backward_start - start
        if not math.isfinite(metrics["loss"]):
            return self._skip_step(metrics, f"non-finite {self.config.loss.name} loss ({metrics['loss']})", start)
        loss.backward()
        if self.lora is not None:  # FSDP2 reduces the base's gradients, not those of the adapters
            self.lora.reduce_gradients(self._dp_group)
        optimizer_start = time.perf_counter()
        metrics[TRAINER_BACKWARD_S] = optimizer_start - backward_start
        metrics["grad_norm"] = self._clip_grad_norm()
        if not math.isfinite(metrics["grad_norm"]):
            self.optimizer.zero_grad(set_to_none=True)
            return self._skip_step(metrics, f"non-finite gradient norm ({metrics['grad_norm']})", start)
        # A batch without signal (every group's advantages zero, no KL or entropy term) has a zero
        # gradient, yet AdamW would still move the weights: by its momentum from earlier batches and
        # by weight decay. Runs of such batches then kept pushing the policy the way the last
        # batches with signal had, and once pushed it into a calculator-recipe collapse (reward 0,
        # entropy rising with no gradient: docs/recipes.md, the calculator recipe). No signal, no update; the version
        # still advances, so the loop's accounting is the same as for any step.
        metrics["step_without_gradient"] = float(metrics["grad_norm"] == 0.0)
        if not metrics["step_without_gradient"]:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.policy_version += 1
        self.num_consecutive_nonfinite_steps = 0
        metrics["step_skipped"] = 0
        metrics["step_time_s"] = time.perf_counter() - start
        metrics[TRAINER_OPTIMIZER_S] = time.perf_counter() - optimizer_start
        return metrics

    def _layout_metrics(self, counts: dict[str, float]) -> dict[str, float]:
        """Batch-wide tokens of the sequences trained (prompt + completion), the fraction of forward
        slots that were padding under `trainer.batching`, and the fraction of the tokens a prefix
        tree computed for another sequence that shares them (0 outside the tree layout)."""
        input_tokens, computed, slots = self._dp_reduce(
            [counts["input_tokens"], counts["computed"], counts["slots"]], dist.ReduceOp.SUM
        )
        return {
            "num_input_tokens": input_tokens,
            "padding_fraction": 1.0 - computed / max(slots, 1.0),
            "shared_token_fraction": 1.0 - computed / max(input_tokens, 1.0),
        }

    def _clip_grad_norm(self) -> float:
        """Clip to max_grad_norm; returns the global norm before clipping (DTensor shards reduced)."""
        from torchtitan.distributed.utils import clip_grad_norm_

        params = self._trainable_parameters()
        # Under EP the expert gradients live on another mesh than the rest: TorchTitan norms each
        # group over its own mesh, then combines them.
        ep_enabled = self.config.parallel.ep > 1
        return clip_grad_norm_(params, self.config.max_grad_norm, foreach=True, ep_enabled=ep_enabled).item()

    def _skip_step(self, metrics: dict, reason: str, start: float) -> dict:
        """Leave weights, optimizer and version as they are; raise after too many skips in a row."""
        self.num_consecutive_nonfinite_steps += 1
        count, limit = self.num_consecutive_nonfinite_steps, self.config.max_consecutive_nonfinite_steps
        if count >= limit:
            raise FloatingPointError(
                f"{reason} at policy version {self.policy_version}: {count} consecutive steps were not "
                f"finite (trainer.max_consecutive_nonfinite_steps = {limit}), so training stops; the "
                "weights are those of the last finite step. Lower --trainer.lr, check the reward function "
                "and the batch for NaN/inf, or raise --trainer.max-consecutive-nonfinite-steps."
            )
        if self.rank == 0:
            print(
                f"[forge-rl] trainer: skipped a step, {reason} at policy version {self.policy_version}; "
                f"weights and optimizer untouched ({count} of {limit} allowed in a row, "
                "--trainer.max-consecutive-nonfinite-steps)",
                file=sys.stderr,
                flush=True,
            )
        metrics.setdefault("grad_norm", math.nan)
        metrics["step_skipped"] = 1
        metrics["step_time_s"] = time.perf_counter() - start
        return metrics

    def save_checkpoint(self, path: Path | str) -> None:
        """Write this rank's part of the training state to the DCP checkpoint `path`: a
        collective, so call it on every rank. Each rank writes only its own FSDP2/TP shards.
        With LoRA the checkpoint holds the adapters and their AdamW moments, not the frozen base
        (the base is `model.path`, read again at resume). Writes from the live tensors, with no
        host copy of the state: `start_checkpoint` is the background variant."""
        import torch.distributed.checkpoint as dcp

        self.wait_for_checkpoint()
        dcp.save(self._checkpoint_state(), checkpoint_id=str(path), no_dist=not dist.is_initialized())

    def start_checkpoint(self, path: Path | str) -> concurrent.futures.Future:
        """`save_checkpoint` in the background: copies this rank's part of the training state to
        host memory now (DCP's staging), then writes the copy in a thread of DCP's while the
        caller goes on, so optimizer steps may change the live tensors meanwhile. Returns the
        write's future (its error, if any, is raised by it and by `wait_for_checkpoint`). A write
        still running from before is waited for first. A collective: call it on every rank, in the
        same order as the training steps.

        The thread's collectives (DCP agrees on a plan, and rank 0 gathers every rank's writes
        before it writes the metadata) run on a gloo group of their own, as TorchTitan's async
        checkpointing does, so they never interleave with the training steps' on the default
        group. Rank 0's future is done only once every rank's shards are written."""
        import torch.distributed.checkpoint as dcp

        self.wait_for_checkpoint()
        distributed = dist.is_initialized()
        if distributed and self._checkpoint_group is None:
            self._checkpoint_group = dist.new_group(backend="gloo")
        self._checkpoint_write = dcp.async_save(
            self._checkpoint_state(),
            checkpoint_id=str(path),
            process_group=self._checkpoint_group,
            no_dist=not distributed,
        )
        return self._checkpoint_write

    def wait_for_checkpoint(self) -> None:
        """Waits for the write `start_checkpoint` began, if any; raises what it raised."""
        write, self._checkpoint_write = self._checkpoint_write, None
        if write is not None:
            write.result()

    def load_checkpoint(self, path: Path | str) -> None:
        """Restore what `save_checkpoint` wrote (same model and parallelism): weights (or adapters),
        AdamW moments and step counts, this rank's torch RNG state, the policy version. A
        collective. A checkpoint of the other kind (full vs LoRA), or adapters of another rank or
        set of layers, is refused naming the mismatch and the flag before anything is read."""
        import torch.distributed.checkpoint as dcp

        self.wait_for_checkpoint()
        self._check_checkpoint_kind(dcp.FileSystemReader(str(path)).read_metadata())
        state = self._checkpoint_state()
        dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())  # in place, into this rank's shards
        torch.set_rng_state(state["rng"][f"rank{self.rank}"])
        self.policy_version = int(state["progress"]["policy_version"])
        self.num_consecutive_nonfinite_steps = int(state["progress"]["num_consecutive_nonfinite_steps"])

    def _check_checkpoint_kind(self, metadata) -> None:
        """Full weights are saved under "model.", LoRA adapters under "adapters." (full shapes)."""
        shapes = {
            key.removeprefix(f"{_ADAPTERS}."): tuple(entry.size)
            for key, entry in metadata.state_dict_metadata.items()
            if key.startswith(f"{_ADAPTERS}.")
        }
        if self.lora is None and shapes:
            raise ValueError(
                f"the checkpoint holds LoRA adapters (e.g. {next(iter(shapes))}), not full weights, and "
                "trainer.lora.enabled is false. Resume with --trainer.lora.enabled true and the "
                "--trainer.lora.rank and --trainer.lora.targets it was trained with."
            )
        if self.lora is not None and not shapes:
            raise ValueError(
                "the checkpoint holds full weights, not LoRA adapters, and trainer.lora.enabled is true. "
                "Resume with --trainer.lora.enabled false."
            )
        if self.lora is not None:
            self.lora.check_fits(shapes)

    def _checkpoint_state(self) -> dict:
        """What a checkpoint holds, keyed by parameter name; the tensors are the live ones, so DCP
        loads in place. The fused QKV module defeats `torch.distributed.checkpoint.state_dict`
        (`get_state_dict` walks the un-fused names that `model.state_dict()` reports), so the
        parameters are taken as the model registers them, and the AdamW state per parameter, created
        empty first on a fresh optimizer so that a load has tensors to fill. The LR is constant
        (trainer.lr, from the config), so there is no schedule to save."""
        from torch.optim.optimizer import _get_scalar_dtype

        reshard(self.model)
        if self.lora is not None:
            section, params = _ADAPTERS, self.lora.named_adapter_parameters()
        else:
            # Names without activation checkpointing's wrapper, so a resume may switch it on or off.
            section = "model"
            params = {name.replace("_checkpoint_wrapped_module.", ""): p for name, p in self.model.named_parameters()}
        stepped = {id(param) for group in self.optimizer.param_groups for param in group["params"]}
        if any(id(param) not in stepped for param in params.values()):
            raise RuntimeError("the registered parameters are not those the optimizer steps")
        optimizer = {}
        for name, param in params.items():
            moments = self.optimizer.state[param]
            if not moments:
                moments.update(
                    step=torch.tensor(0.0, dtype=_get_scalar_dtype()),
                    exp_avg=torch.zeros_like(param, memory_format=torch.preserve_format),
                    exp_avg_sq=torch.zeros_like(param, memory_format=torch.preserve_format),
                )
            for key, value in moments.items():
                optimizer[f"{name}.{key}"] = value
        return {
            section: params,
            "optimizer": optimizer,
            # One key per rank: each restores its own stream (DCP would keep one copy of a shared key).
            "rng": {f"rank{self.rank}": torch.get_rng_state()},
            "progress": {
                "policy_version": self.policy_version,
                "num_consecutive_nonfinite_steps": self.num_consecutive_nonfinite_steps,
            },
        }

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """[N, L] fp32 logprob of each token under the current weights (0 at position 0 and on
        padding), on CPU."""
        shard = batch.shard(self._dp_rank, self._dp_size)
        logprobs_NL, _, _ = self._token_logprobs(shard)
        if self._dp_group is None:
            return logprobs_NL.cpu()
        pieces = [torch.empty_like(logprobs_NL) for _ in range(self._dp_size)]
        dist.all_gather(pieces, logprobs_NL, group=self._dp_group)
        return torch.cat(pieces).cpu()

    def hf_state_dict(self, dtype: torch.dtype = torch.float32, keep: bool = True) -> dict[str, torch.Tensor]:
        """Full weights in HF names; a collective, so call it on every rank. `keep=False` (ranks
        that do not publish) joins the gathers without copying anything to host memory: {}.
        With LoRA: the merged weights (base + scaling * B A), what the adapted model computes;
        ValueError for an lm_head adapter on tied embeddings, which no merge represents."""
        if self.lora is None:
            return export_hf_state_dict(self.model, dtype, keep)
        reshard(self.model)  # the merge adds to the registered weights, which must be the shards
        with self.lora.merged():
            return export_hf_state_dict(self.model, dtype, keep)

    def adapter_state_dict(self, dtype: torch.dtype = torch.float32, keep: bool = True) -> dict[str, torch.Tensor]:
        """The LoRA adapters alone, full (unsharded) CPU copies keyed by TorchTitan module name
        ("layers.0.attention.qkv_linear.wqkv.lora_A": [rank, in_features], "...lora_B":
        [out_features, rank]); the served delta is trainer.lora.scaling * B @ A. A collective
        under TP (call it on every rank); `keep=False` joins the gathers and returns {}."""
        if self.lora is None:
            raise ValueError(
                "adapter_state_dict needs LoRA: trainer.lora.enabled is false. Set --trainer.lora.enabled."
            )
        return self.lora.adapter_state_dict(dtype, keep)
