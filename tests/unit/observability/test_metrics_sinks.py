"""Metrics sinks: what MetricsLogger writes to metrics.jsonl, TensorBoard and W&B (offline) reads back."""

from __future__ import annotations

import json
import math
import struct
import time
from pathlib import Path

import pytest

from forge_rl.config import LogConfig
from forge_rl.observability.sinks import MetricsLogger, TensorBoardSink, WandbSink, open_sinks

STEPS = [
    {
        "step": step,
        "wall_time_s": 2.0 * step,
        "reward/mean": 0.25 * step,
        "loss": -0.1 * step,
        "step_skipped": int(step == 2),
        "policy_age/max": 1,
        "policy_age/histogram": {"0": 10 * step, "1": 5},
        "generator/policy_versions": [step, step - 1],
        "throughput/generated_tokens_per_s": 100.0,
        "throughput/trained_tokens_per_s": 50.0,
        "buffer/dropped_completions": 0,
    }
    for step in (1, 2, 3)
]


def log_steps(run_path: Path, sinks: list) -> None:
    logger = MetricsLogger(run_path / "metrics.jsonl", total_steps=3, progress_every_s=0.0, sinks=sinks)
    for metrics in STEPS:
        logger.log(metrics)
    logger.close()


def test_tensorboard_gets_every_scalar_and_the_policy_age_histogram(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_steps(tmp_path, [TensorBoardSink(tmp_path / "tensorboard")])
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    reward = [(e.step, e.value) for e in events.Scalars("reward/mean")]
    assert reward == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert [e.value for e in events.Scalars("generator/policy_versions/1")] == [0.0, 1.0, 2.0]
    assert [e.value for e in events.Scalars("step_skipped")] == [0.0, 1.0, 0.0]
    histograms = events.Histograms("policy_age")
    assert [h.step for h in histograms] == [1, 2, 3]
    assert list(histograms[-1].histogram_value.bucket) == [30.0, 5.0]  # ages 0 and 1


def test_wandb_offline_writes_history_and_config_without_network(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # any network use would fail
    run_path = tmp_path / "grpo-test"
    run_path.mkdir()
    log_steps(run_path, [WandbSink(run_path, "forge_rl-tests", "offline", {"steps": 3, "trainer": {"lr": 3e-4}})])
    records, history = wait_for_wandb_history(run_path, num_steps=3)
    assert [h["reward/mean"] for h in history] == [0.25, 0.5, 0.75]
    assert [h["_step"] for h in history] == [1, 2, 3]
    assert history[0]["policy_age/values"] == [10, 5] and history[0]["policy_age/_type"] == "histogram"
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name == "grpo-test" and run.project == "forge_rl-tests"
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["trainer"] == {"lr": 3e-4}


def wait_for_wandb_history(run_path: Path, num_steps: int, timeout_s: float = 120.0):
    """The offline log's records and history rows, once `num_steps` rows are there: wandb's service
    process writes the log asynchronously, and may still be writing after `finish()` on a busy machine."""
    deadline = time.monotonic() + timeout_s
    while True:
        records, history = [], []
        for log_file in run_path.glob("wandb/offline-run-*/run-*.wandb"):
            records = list(read_wandb_records(log_file))
            history = [
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
                for r in records
                if r.WhichOneof("record_type") == "history"
            ]
        if len(history) >= num_steps or time.monotonic() > deadline:
            return records, history
        time.sleep(0.2)


def read_wandb_records(path: Path):
    """Records of a W&B transaction log (.wandb): LevelDB log format, 32 KiB blocks, after a 7-byte
    ':W&B' header. wandb 0.31 ships no Python reader, so this is the format's dozen lines."""
    from wandb.proto import wandb_internal_pb2

    block_size, header_size, full, last = 32768, 7, 1, 4
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    position, pending = header_size, b""
    while position + header_size <= len(data):
        left_in_block = block_size - position % block_size
        _, length, kind = struct.unpack("<IHB", data[position : position + header_size])
        if left_in_block < header_size or (length == 0 and kind == 0):  # block padding
            position += left_in_block
            continue
        pending += data[position + header_size : position + header_size + length]
        position += header_size + length
        if kind in (full, last):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_open_sinks_follows_the_log_config(tmp_path):
    assert open_sinks(LogConfig(), tmp_path, {}) == []
    sinks = open_sinks(LogConfig(tensorboard=True), tmp_path, {})
    assert [type(s) for s in sinks] == [TensorBoardSink]
    sinks[0].close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


class BrokenSink:
    def log(self, step, metrics):
        raise ConnectionError("dashboard unreachable")

    def close(self):
        raise AssertionError("a dropped sink is not closed")


def test_a_failing_sink_is_dropped_and_the_jsonl_record_goes_on(tmp_path, capsys):
    log_steps(tmp_path, [BrokenSink()])
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
    stderr = capsys.readouterr().err
    assert stderr.count("metrics sink BrokenSink failed and is turned off: ConnectionError") == 1


def test_the_progress_line_shows_eta_and_skipped_steps(tmp_path):
    logger = MetricsLogger(tmp_path / "metrics.jsonl", total_steps=10, progress_every_s=60.0)
    for metrics in STEPS[:2]:
        logger.log(metrics)
    line = logger.progress_line(STEPS[1])
    logger.close()
    assert line.startswith("step 2/10 | reward 0.500 | loss -0.2000")
    assert "skipped steps 1" in line
    assert line.endswith("4s, eta 0m16s")  # 2 s per step, 8 steps to go


def test_a_skipped_step_with_nan_loss_still_formats(tmp_path):
    logger = MetricsLogger(tmp_path / "metrics.jsonl", total_steps=3, progress_every_s=0.0)
    assert "loss +nan" in logger.progress_line({"step": 1, "loss": math.nan, "step_skipped": 1})
    logger.close()


def test_a_simulated_steps_progress_line_says_so_instead_of_a_loss_it_never_had(tmp_path):
    logger = MetricsLogger(tmp_path / "metrics.jsonl", total_steps=3, progress_every_s=0.0)
    line = logger.progress_line({"step": 1, "simulated": 1, "reward/mean": 0.0})
    logger.close()
    assert line.startswith("step 1/3 | SIMULATED | gen") and "loss" not in line and "reward" not in line


def fabricated_run(run_path: Path, num_steps: int = 6, with_timeline: bool = True) -> Path:
    from forge_rl.observability.timeline import Interval

    run_path.mkdir(parents=True, exist_ok=True)
    (run_path / "config.yaml").write_text("buffer:\n  capacity_episodes: 8\n")
    rows = [
        {
            "step": step,
            "wall_time_s": 2.0 * step,
            "reward/mean": step / num_steps,
            "loss": 0.1 / step,
            "grad_norm": 1.0,
            "step_skipped": int(step == 3),
            "completions/errored": int(step % 2),
            "throughput/generated_tokens_per_s": 900.0,
            "throughput/trained_tokens_per_s": 300.0,
            "policy_age/mean": 0.5,
            "policy_age/max": 1,
            "policy_age/histogram": {"0": 40, "1": 20 + step},
            "weights/publish_s": 0.02,
            "weights/load_s": 0.1,
            "weights/stall_s": 0.05,
            "buffer/size": step % 4 + 2,
            "buffer/dropped_episodes": 0,
            "idle_fraction/trainer": 0.6,
            "idle_fraction/generators": 0.1,
        }
        for step in range(1, num_steps + 1)
    ]
    (run_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if with_timeline:
        intervals = [Interval("trainer", 2.0 * s, 2.0 * s + 0.5) for s in range(num_steps)]
        intervals += [Interval("generator0", 0.0, 2.0 * num_steps - 1, 8), Interval("scorer", 1.0, 1.1)]
        (run_path / "timeline.jsonl").write_text("".join(json.dumps(i.__dict__) + "\n" for i in intervals))
    return run_path


@pytest.mark.parametrize("with_timeline", [True, False], ids=["finished_run", "live_run"])
def test_the_dashboard_plots_a_run(tmp_path, with_timeline):
    from forge_rl.observability.plot import PlotArgs, plot_dashboard

    run_path = fabricated_run(tmp_path / "run", with_timeline=with_timeline)
    out = plot_dashboard(PlotArgs(run_path))
    assert out == run_path / "dashboard.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_dashboard_plots_each_eval_sets_pass_at_k_beside_the_reward(tmp_path, monkeypatch):
    from forge_rl.observability import plot

    run_path = fabricated_run(tmp_path / "run", with_timeline=False)
    records = [{"step": s, "policy_version": s, "eval/held_out/pass@1": s / 10} for s in (0, 2)]
    (run_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    plotted = []
    original = plot._evaluations
    monkeypatch.setattr(
        plot, "_evaluations", lambda axis, *args: plotted.append(original(axis, *args) or axis.get_lines())
    )
    plot.plot_dashboard(plot.PlotArgs(run_path))
    (lines,) = plotted
    assert [line.get_label() for line in lines][-1] == "held_out/pass@1"
    assert list(lines[-1].get_ydata()) == [0.0, 0.2]


def test_plotting_a_run_without_steps_says_so(tmp_path):
    from forge_rl.observability.plot import PlotArgs, plot_dashboard

    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="has no steps yet"):
        plot_dashboard(PlotArgs(tmp_path))
