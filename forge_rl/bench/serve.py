"""`forge-rl bench serve`: training and sampling through `forge-rl serve` with one tenant and with
two at once, driven by the official Tinker SDK as users' loops drive it.

One service (the command in its own process, on a tiny model by default or --model-path), then in
one invocation, so that the figures share the machine's load:

    train_steps_per_s_<n>_tenants   forward_backward (--datums sequences of --sequence-tokens) +
                                    optim_step per step, summed over n tenants stepping at once
                                    (each from its own thread, as separate users would)
    sample_tokens_per_s_<n>_tenants sampled tokens per second, n tenants sampling at once
    save_to_sample_s                a tenant's save_weights_and_get_sampling_client until its
                                    first sample is back (the adapter's publish, its load into
                                    a generator, one short sample), median over the saves

`two_tenant_train_speedup` is the two-tenant figure over the one-tenant one: how much of a second
tenant's training the service carries without slowing the first. Two tenants' steps are
serialized on the trainer mesh (each call makes its tenant's adapters the live ones), so the
figure stays near 1 on a machine whose cores the trainer already uses; the sampling figure is
where tenants share: their requests decode in one engine batch over mixed adapters (vLLM
multi-LoRA). Figures go to OUT_DIR/serve.json; the last stdout line is the JSON summary.
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from forge_rl.errors import ConfigError
from forge_rl.observability.metrics import progress

_START_S = 600


@dataclass(frozen=True)
class ServeBenchArgs:
    model_path: Path | None = None
    """An HF model directory to serve (e.g. models/SmolLM2-135M-Instruct); unset: the tiny model."""
    rank: int = 16
    """Every tenant's LoRA rank."""
    steps: int = 20
    """Training steps per tenant and mode."""
    datums: int = 16
    """Sequences per forward_backward."""
    sequence_tokens: int = 64
    """Tokens per sequence (within the model's context)."""
    sample_requests: int = 16
    """Sample requests per tenant and mode."""
    num_samples: int = 4
    max_tokens: int = 16
    saves: int = 5
    """Saves timed for save_to_sample_s."""
    out_dir: Path = Path("runs/bench-serve")


def main(args: ServeBenchArgs) -> dict:
    import tinker

    if min(args.steps, args.datums, args.sequence_tokens, args.sample_requests, args.num_samples, args.saves) < 1:
        raise ConfigError(
            "bench serve: --steps, --datums, --sequence-tokens, --sample-requests, --num-samples and --saves must be >= 1."
        )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    name = f"serve-{time.strftime('%Y%m%d-%H%M%S')}"
    service = _start_service(args, name)
    try:
        client = tinker.ServiceClient(base_url=service["url"], api_key="tml-bench")
        base_model = service["base_model"]
        tenants = [
            client.create_lora_training_client(base_model=base_model, rank=args.rank, seed=i).result() for i in range(2)
        ]
        rng = np.random.default_rng(0)
        datums = [_datum(tinker, rng, args.sequence_tokens) for _ in range(args.datums)]
        adam = tinker.AdamParams(learning_rate=1e-4)
        for training in tenants:  # warm-up: first calls pay for allocation and the first adapter loads
            training.forward_backward(datums, "cross_entropy").result()
            training.optim_step(adam).result()

        def train(training) -> float:
            started = time.perf_counter()
            for _ in range(args.steps):
                # As the cookbook's loops do: both calls submitted, then both results awaited.
                backward, step = training.forward_backward(datums, "cross_entropy"), training.optim_step(adam)
                backward.result(), step.result()
            return time.perf_counter() - started

        samplers = [t.save_weights_and_get_sampling_client().result() for t in tenants]
        prompt = tinker.ModelInput.from_ints([int(x) for x in rng.integers(1, 20, size=8)])
        params = tinker.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, stop=[])

        for sampler in samplers:  # warm-up: each adapter's first request loads it into the engine
            sampler.sample(prompt, 1, params).result()

        def sample(sampler) -> tuple[float, int]:
            started = time.perf_counter()
            futures = [sampler.sample(prompt, args.num_samples, params) for _ in range(args.sample_requests)]
            tokens = sum(len(s.tokens) for f in futures for s in f.result().sequences)
            return time.perf_counter() - started, tokens

        figures: dict = {}
        for n in (1, 2):
            progress(f"bench serve: {n} tenant(s) training, {args.steps} steps each")
            seconds = _at_once(train, tenants[:n])
            figures[f"train_steps_per_s_{n}_tenants"] = n * args.steps / max(seconds)
            progress(f"bench serve: {n} tenant(s) sampling, {args.sample_requests} requests each")
            timings = _at_once(sample, samplers[:n])
            figures[f"sample_tokens_per_s_{n}_tenants"] = sum(t for _, t in timings) / max(s for s, _ in timings)
        figures["two_tenant_train_speedup"] = (
            figures["train_steps_per_s_2_tenants"] / figures["train_steps_per_s_1_tenants"]
        )
        figures["two_tenant_sample_speedup"] = (
            figures["sample_tokens_per_s_2_tenants"] / figures["sample_tokens_per_s_1_tenants"]
        )
        short = tinker.SamplingParams(max_tokens=1, temperature=1.0, stop=[])
        saves = []
        for _ in range(args.saves):
            tenants[0].forward_backward(datums, "cross_entropy").result()
            tenants[0].optim_step(adam).result()
            started = time.perf_counter()
            tenants[0].save_weights_and_get_sampling_client().result().sample(prompt, 1, short).result()
            saves.append(time.perf_counter() - started)
        figures["save_to_sample_s"] = statistics.median(saves)
    finally:
        summary_line = _stop_service(service)
    summary = {
        "benchmark": "serve",
        "base_model": service["base_model"],
        "rank": args.rank,
        "datums": args.datums,
        "sequence_tokens": args.sequence_tokens,
        "steps": args.steps,
        "two_tenant_training": "serialized",
        **{k: round(v, 4) for k, v in figures.items()},
        "service": summary_line,
    }
    (args.out_dir / "serve.json").write_text(json.dumps(summary, indent=2))
    return summary


def _datum(tinker, rng, length: int):
    tokens = [int(x) for x in rng.integers(1, 40, size=length + 1)]
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.array(tokens[1:], dtype=np.int64),
            "weights": np.ones(length, dtype=np.float32),
        },
    )


def _at_once(work, items: list) -> list:
    """`work(item)` for every item at once, each in its own thread (the SDK's calls block)."""
    with concurrent.futures.ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(work, items))


def _start_service(args: ServeBenchArgs, name: str) -> dict:
    command = [
        sys.executable,
        "-m",
        "forge_rl.cli",
        "serve",
        "--port",
        "0",
        "--run-dir",
        str(args.out_dir),
        "--run-name",
        name,
        "--trainer.lora.rank",
        str(args.rank),
    ]
    if args.model_path is not None:
        command += ["--model.path", str(args.model_path)]
    log = args.out_dir / f"{name}.log"
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    server_file = args.out_dir / name / "server.json"
    deadline = time.monotonic() + _START_S
    while not server_file.is_file():
        if process.poll() is not None:
            raise ConfigError(f"bench serve: forge-rl serve exited with {process.returncode}; its log: {log}")
        if time.monotonic() > deadline:
            process.kill()
            raise ConfigError(f"bench serve: forge-rl serve did not listen within {_START_S} s; its log: {log}")
        time.sleep(0.2)  # a file another process writes once: nothing to wait on but it
    return {**json.loads(server_file.read_text()), "process": process, "log": log}


def _stop_service(service: dict) -> dict:
    """Stop the service as a supervisor does (SIGTERM: a bench started in the background holds
    SIGINT ignored, and so would the service); its summary line (requests served, refused)."""
    process = service["process"]
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        process.kill()
        return {}
    lines = service["log"].read_text().strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        return {}
