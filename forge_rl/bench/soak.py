"""`forge-rl bench soak`: run the recipe for a long time and watch its memory.

Starts `forge-rl grpo` as a subprocess with an unreachable step count, samples the memory of every
process of the run (the controller and all its descendants: actors, vLLM engines, trainer ranks)
every `sample_every_s` (each sample is appended to OUT_DIR/samples.jsonl as it is taken, so nothing
is lost if the driver dies), and stops the run with SIGTERM after `duration_s`. SIGTERM, not SIGINT:
a run started from a background shell inherits an ignored SIGINT and would not stop. Reports the growth of
the total unique memory (USS: pages no other process shares, so mapped /dev/shm snapshots are not
counted once per reader) between the end of the warm-up and the end of the run, each role's fitted slope of resident memory
after warm-up (MB per hour) and what it adds in 24 hours (`growth_slopes`), and the largest
replay-buffer occupancy logged, against its capacity. Not a test: a command for docs/benchmarks/README.md.
"""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from forge_rl.config import GRPOConfig
from forge_rl.observability.metrics import final_reward
from forge_rl.observability.plot import headless_pyplot, read_metrics, save_figure

# Samples averaged at each end of the comparison, so one noisy sample cannot decide it.
_SAMPLES_PER_END = 3


@dataclass(frozen=True)
class SoakArgs:
    config: Path = Path("configs/grpo_tiny_cpu.yaml")
    """Recipe config of the soaked run."""
    duration_s: float = 1800.0
    """How long the run trains before it is stopped with SIGTERM."""
    warmup_s: float = 180.0
    """Memory growth is measured from this long after the first step (caches and pools fill first)."""
    sample_every_s: float = 10.0
    """Seconds between memory samples."""
    out_dir: Path = Path("runs/bench-soak")
    """Where the run directory, soak.json and soak.png go."""


def process_tree_memory(root: psutil.Process, known: dict[int, str]) -> tuple[int, int, dict[str, int], dict[str, int]]:
    """(total RSS, total USS, USS by role, RSS by role) in bytes of `root` and its descendants (see
    `role`; `known`: roles by pid, from the run's processes.json)."""
    rss = uss = 0
    uss_by_role: dict[str, int] = {}
    rss_by_role: dict[str, int] = {}
    for process in [root, *root.children(recursive=True)]:
        try:
            info = process.memory_full_info()
            name = known.get(process.pid) or role(process, root)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        rss += info.rss
        uss += info.uss
        uss_by_role[name] = uss_by_role.get(name, 0) + info.uss
        rss_by_role[name] = rss_by_role.get(name, 0) + info.rss
    return rss, uss, uss_by_role, rss_by_role


def known_roles(run_path: Path) -> dict[int, str]:
    """Roles by pid that the run wrote to processes.json: the rollouts' process, the scorer's
    processes, and each trainer rank apart (`trainer_rank0` publishes the weights, the others do
    not). `role` names the rest from their command lines."""
    path = run_path / "processes.json"
    if not path.is_file():
        return {}
    processes = json.loads(path.read_text())
    known = {pid: f"trainer_rank{rank}" for rank, pid in enumerate(processes.get("trainer", []))}
    known.update({pid: "scorer_proc" for pid in processes.get("scorer", [])})
    if "rollouts" in processes:
        known[processes["rollouts"]] = "rollouts_proc"
    return known


def role(process: psutil.Process, root: psutil.Process) -> str:
    """What a process of the run is, from its command line and its children: the controller, a
    Monarch proc hosting a generator (its child is vLLM's engine core), the services with their
    reward workers, any other Monarch proc (the services without reward workers, a reference
    or teacher rank; trainer ranks and the scorer's and rollouts' processes are `known_roles`),
    or one of vLLM's and the scorer's own processes."""
    if process.pid == root.pid:
        return "controller"
    command = " ".join(process.cmdline())
    name = process.name()
    if "EngineCore" in name or "EngineCore" in command:
        return "vllm_engine_core"
    if "Worker" in name and "VLLM" in name:
        return "vllm_worker"
    if "forge_rl.scoring.reward_workers" in command:
        return "reward_worker"
    if "monarch" not in command:
        return "other"
    children = " ".join(" ".join(c.cmdline()) + c.name() for c in process.children())
    if "EngineCore" in children:
        return "generator_proc"
    if "forge_rl.scoring.reward_workers" in children:
        return "services_proc"
    return "monarch_proc"


def main(args: SoakArgs) -> dict:
    from forge_rl.observability.metrics import progress
    from forge_rl.yaml_config import load_yaml_config

    base = load_yaml_config(GRPOConfig, args.config)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    run_path = args.out_dir / "soak"
    command = [
        sys.executable,
        "-m",
        "forge_rl.cli",
        "grpo",
        "--config",
        str(args.config),
        "--steps",
        "100000000",
        "--run-dir",
        str(args.out_dir),
        "--run-name",
        "soak",
        "--log.progress-every-s",
        "60",
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    samples, first_step_at = [], None
    deadline = None
    samples_file = open(args.out_dir / "samples.jsonl", "w", buffering=1)
    try:
        while process.poll() is None and (deadline is None or time.monotonic() < deadline):
            time.sleep(args.sample_every_s)
            if first_step_at is None and (run_path / "metrics.jsonl").is_file():
                first_step_at = time.monotonic()
                deadline = first_step_at + args.duration_s
                progress(f"bench soak: training; sampling memory for {args.duration_s:.0f} s")
            if first_step_at is not None:
                rss, uss, uss_by_role, rss_by_role = process_tree_memory(
                    psutil.Process(process.pid), known_roles(run_path)
                )
                samples.append(
                    {
                        "t_s": time.monotonic() - first_step_at,
                        "rss_bytes": rss,
                        "uss_bytes": uss,
                        "uss_by_role": uss_by_role,
                        "rss_by_role": rss_by_role,
                    }
                )
                samples_file.write(json.dumps(samples[-1]) + "\n")
    finally:
        samples_file.close()
        stop(process)
    summary = summarize(samples, read_metrics(run_path), base, args)
    print(
        f"USS after warm-up {summary['uss_after_warmup_mb']:.0f} MB, at the end {summary['uss_at_end_mb']:.0f} MB "
        f"({summary['memory_growth_fraction']:+.1%}); growth by process role:"
    )
    for name, growth_mb in summary["uss_growth_mb_by_role"].items():
        print(f"  {name:<18}{growth_mb:+9.1f} MB")
    (args.out_dir / "soak.json").write_text(json.dumps({**summary, "samples": samples}, indent=2))
    plot(samples, args, args.out_dir / "soak.png")
    return summary


def stop(process: subprocess.Popen) -> None:
    """SIGTERM the run (it stops every process of its own); kill what is left after a minute."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        for child in psutil.Process(process.pid).children(recursive=True):
            child.kill()
        process.kill()


def summarize(samples: list[dict], metrics: list[dict], config: GRPOConfig, args: SoakArgs) -> dict:
    after_warmup = [s for s in samples if s["t_s"] >= args.warmup_s]
    if len(after_warmup) < 2 * _SAMPLES_PER_END:
        raise RuntimeError(f"only {len(after_warmup)} samples after warm-up: raise --duration-s")

    def mean_uss(window: list[dict]) -> float:
        return sum(s["uss_bytes"] for s in window) / len(window)

    start, end = mean_uss(after_warmup[:_SAMPLES_PER_END]), mean_uss(after_warmup[-_SAMPLES_PER_END:])

    def mean_by_role(window: list[dict], key: str = "uss_by_role") -> dict[str, float]:
        roles = {name for s in window for name in s.get(key, {})}
        return {name: sum(s.get(key, {}).get(name, 0) for s in window) / len(window) for name in roles}

    role_start = mean_by_role(after_warmup[:_SAMPLES_PER_END])
    role_end = mean_by_role(after_warmup[-_SAMPLES_PER_END:])
    rss_start = mean_by_role(after_warmup[:_SAMPLES_PER_END], "rss_by_role")
    rss_end = mean_by_role(after_warmup[-_SAMPLES_PER_END:], "rss_by_role")
    rss_growth = {
        name: (rss_end[name] - start_bytes) / start_bytes
        for name, start_bytes in rss_start.items()
        if name in rss_end and start_bytes
    }
    return {
        "duration_s": samples[-1]["t_s"],
        "steps": len(metrics),
        "uss_after_warmup_mb": start / 2**20,
        "uss_at_end_mb": end / 2**20,
        "memory_growth_fraction": (end - start) / start,
        # Which processes grew: the place to look when the total does.
        "uss_growth_mb_by_role": {
            name: (role_end.get(name, 0.0) - role_start.get(name, 0.0)) / 2**20
            for name in sorted(set(role_start) | set(role_end))
        },
        # Resident memory per role, the soak's headline figure: the largest growth over the roles.
        "rss_growth_fraction_by_role": dict(sorted(rss_growth.items())),
        "rss_growth_fraction_max": max(rss_growth.values(), default=None),
        **growth_slopes(after_warmup),
        "buffer_max_episodes": max(m["buffer/size"] for m in metrics),
        "buffer_capacity_episodes": config.buffer.capacity_episodes,
        "final_mean_reward": final_reward(metrics),
    }


HOURS_PROJECTED = 24.0
"""The horizon of the growth projection: RL runs last days."""


def growth_slopes(after_warmup: list[dict]) -> dict:
    """Per role, the least-squares slope of its resident memory over the samples after warm-up
    (MB per hour), and what that slope adds in HOURS_PROJECTED hours as a fraction of its
    resident memory at the first of them: a steady leak shows in the slope where the two ends'
    difference is buried in noise. Roles present in fewer than 3 samples are left out."""
    series: dict[str, list[tuple[float, float]]] = {}
    for sample in after_warmup:
        for name, rss in sample.get("rss_by_role", {}).items():
            series.setdefault(name, []).append((sample["t_s"] / 3600.0, rss / 2**20))
    slopes, projections = {}, {}
    for name, points in sorted(series.items()):
        hours = [t for t, _ in points]
        if len(points) < 3 or max(hours) == min(hours):
            continue
        slope = statistics.linear_regression(hours, [mb for _, mb in points]).slope
        slopes[name] = slope
        projections[name] = slope * HOURS_PROJECTED / points[0][1] if points[0][1] else None
    finite = [p for p in projections.values() if p is not None]
    return {
        "rss_slope_mb_per_hour_by_role": slopes,
        "rss_24h_projection_fraction_by_role": projections,
        "rss_24h_projection_fraction_max": max(finite, default=None),
    }


def plot(samples: list[dict], args: SoakArgs, out: Path) -> None:
    plt = headless_pyplot()

    fig, axis = plt.subplots(figsize=(8, 4))
    t = [s["t_s"] / 60 for s in samples]
    axis.plot(t, [s["uss_bytes"] / 2**30 for s in samples], label="USS (unique)")
    axis.plot(t, [s["rss_bytes"] / 2**30 for s in samples], label="RSS (shared pages counted per process)")
    axis.axvline(args.warmup_s / 60, color="gray", ls="--", lw=0.8)
    axis.set_xlabel("minutes since the first step")
    axis.set_ylabel("GiB, all processes of the run")
    axis.grid(alpha=0.3)
    axis.legend()
    save_figure(fig, out)
