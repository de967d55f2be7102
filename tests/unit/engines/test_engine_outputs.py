"""How `VLLMEngine` turns vLLM's outputs into Completions, and what it refuses before vLLM starts (no engine runs)."""

import asyncio
import math
import os
from types import SimpleNamespace

import pytest
import torch

from forge_rl.engines.config import GeneratorConfig
from forge_rl.engines.vllm_engine import VLLMEngine
from forge_rl.engines.vllm_outputs import to_completion, top_k_of
from forge_rl.engines.vllm_process import engine_process_env, visible_devices
from forge_rl.types import join_pieces


def output(kept_per_token: list[list[int]], returned: int, finish_reason: str = "stop") -> SimpleNamespace:
    """A CompletionOutput of the CPU path: per token the `returned` most likely processed
    logprobs (-inf for those top-p/top-k filtered), the sampled token first."""
    token_ids = [kept[0] for kept in kept_per_token]
    logprobs = []
    for kept in kept_per_token:
        ids = kept + [100 + i for i in range(max(0, returned - len(kept)))]
        logprobs.append({t: SimpleNamespace(logprob=-1.0 if t in kept else -math.inf) for t in ids[:returned]})
    span = SimpleNamespace(version="3", start=0, end=len(token_ids))
    return SimpleNamespace(token_ids=token_ids, logprobs=logprobs, weight_versions=[span], finish_reason=finish_reason)


def test_kept_sets_that_fill_every_returned_logprob_are_counted_as_possibly_truncated():
    completion = to_completion(output([[5, 6], [7, 8, 9, 10], [11]], returned=4), "top_logprobs", 4)

    assert completion.sampling_support == [[5, 6], [7, 8, 9, 10], [11]]
    assert completion.num_truncated_support == 1
    assert completion.policy_versions == [3, 3, 3]


def test_nothing_is_counted_when_every_kept_set_fits():
    """top_k <= max_support_ids: the engine passes None, a full set is the whole set."""
    completion = to_completion(output([[7, 8, 9, 10]], returned=4), "top_logprobs", None)
    assert completion.num_truncated_support == 0


def test_a_resubmitted_completion_keeps_the_count_of_both_pieces():
    head = to_completion(output([[7, 8, 9, 10]], returned=4, finish_reason="abort"), "top_logprobs", 4)
    tail = to_completion(output([[1, 2, 3, 4], [5]], returned=4), "top_logprobs", 4)
    assert join_pieces(head, tail).num_truncated_support == 2


def test_an_engine_sees_its_assigned_devices_through_the_devices_its_process_sees():
    assert visible_devices((1,), None) == "1"
    assert visible_devices((2, 3), "") == "2,3"
    assert visible_devices((1,), "4,5,6,7") == "5"  # a SLURM job step's GPUs
    assert visible_devices((0, 1), "GPU-aa, GPU-bb") == "GPU-aa,GPU-bb"
    with pytest.raises(
        ValueError, match=r"assigned CUDA device 2, but this process sees 2 \(CUDA_VISIBLE_DEVICES=4,5\)"
    ):
        visible_devices((2,), "4,5")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_tensor_parallelism_is_refused_on_cpu_before_vllm_starts(tmp_path):
    engine = VLLMEngine(GeneratorConfig(tensor_parallel_size=2), cuda_devices=(0, 1))
    with pytest.raises(
        ValueError,
        match=r"generator.tensor_parallel_size \(2\) > 1 needs GPUs.*vLLM's CPU backend "
        r"with one worker.*--generator.tensor-parallel-size 1",
    ):
        asyncio.run(engine.start(tmp_path, 64))


def test_an_engine_needs_one_assigned_device_per_tensor_parallel_rank(tmp_path):
    engine = VLLMEngine(GeneratorConfig(), cuda_devices=(0, 1))
    with pytest.raises(
        ValueError, match=r"assigned 2 CUDA device\(s\) \[0, 1\] but generator.tensor_parallel_size is 1"
    ):
        asyncio.run(engine.start(tmp_path, 64))


def test_an_engine_host_process_gets_huge_pages_added_once_to_its_glibc_tunables(monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    env = engine_process_env()
    assert env == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}
    monkeypatch.setenv("GLIBC_TUNABLES", env["GLIBC_TUNABLES"])
    assert engine_process_env() == env


@pytest.mark.skipif(torch.cuda.is_available(), reason="the start method is vLLM's own on GPUs")
@pytest.mark.parametrize(
    "cpu_threads,started_with_env,expected",
    [(1, True, "fork"), (2, True, "inherited"), (1, False, "inherited")],
    ids=["one-thread-engine-host-forks", "threads-would-hang-a-fork", "malloc-settings-missing"],
)
def test_the_engine_core_is_forked_only_where_the_child_can_run_as_a_spawned_one(
    monkeypatch, cpu_threads, started_with_env, expected
):
    """A fork keeps the parent's malloc settings and breaks a multi-thread OpenMP pool: the engine
    core is forked only from a process started with engine_process_env, at one thread."""
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    if started_with_env:
        monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
    else:
        monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    engine = VLLMEngine(GeneratorConfig(cpu_threads=cpu_threads))
    threads_before = torch.get_num_threads()
    with engine._engine_core_start():
        method = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD", "inherited")
        threads_inside = torch.get_num_threads()
        tunables_inside = os.environ.get("GLIBC_TUNABLES", "")
    assert method == expected
    assert "glibc.malloc.hugetlb=1" in tunables_inside.split(":")
    if expected == "fork":
        assert threads_inside == 1
    assert torch.get_num_threads() == threads_before
    assert "VLLM_WORKER_MULTIPROC_METHOD" not in os.environ


def test_an_engine_start_removes_the_socket_directories_of_engines_whose_process_is_gone(tmp_path, monkeypatch):
    """A SIGKILL of an engine's whole process tree (its reaper too) leaves its socket directory;
    the next start on the machine removes it, and never a live engine's or a fresh one."""
    import subprocess
    import sys
    import tempfile

    from forge_rl.engines.vllm_process import remove_dead_engines_socket_dirs

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    dead_pid = int(gone.stdout)
    an_hour = 3600.0  # past the sweep's 10 minutes
    dead_old = tmp_path / f"forge_rl_vllm_{dead_pid}_abc"
    dead_fresh = tmp_path / f"forge_rl_vllm_{dead_pid}_def"  # a starting engine in another pid namespace, maybe
    alive_old = tmp_path / f"forge_rl_vllm_{os.getpid()}_ghi"
    unrelated = tmp_path / "forge_rl_vllm_notapid_x"
    for path in (dead_old, dead_fresh, alive_old, unrelated):
        (path / "sockets").mkdir(parents=True)
    for path in (dead_old, alive_old, unrelated):
        os.utime(path, (path.stat().st_atime - an_hour, path.stat().st_mtime - an_hour))

    assert remove_dead_engines_socket_dirs() == [str(dead_old)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (dead_fresh, alive_old, unrelated))


def test_a_sampled_turn_carries_the_count_of_its_possibly_truncated_kept_sets():
    """`generate_turn` hands an environment's turn the same count a completion gets (no engine runs:
    the request's output is a fabricated CPU-path one)."""
    engine = object.__new__(VLLMEngine)
    engine.max_model_len, engine._abort_epoch = 64, 0
    piece = to_completion(output([[5, 6], [7, 8, 9, 10], [11]], returned=4), "top_logprobs", 4)

    async def request(prompt_token_ids, params):
        return SimpleNamespace(outputs=[SimpleNamespace(finish_reason="stop")]), 3

    engine._sampling_params = lambda *args: None
    engine._request = request
    engine._completion = lambda output, version: piece
    turn = asyncio.run(engine.generate_turn([1, 2], 8, eos_id=11))

    assert (turn.token_ids, turn.num_truncated_support) == ([5, 7, 11], 1)


def test_a_positions_top_k_is_its_k_likeliest_by_rank_without_the_own_token_past_k_or_masked_ones():
    from vllm.logprobs import Logprob

    # vLLM's logprobs of one position: the top 2 by rank, and the sampled token at rank 5.
    position = {7: Logprob(-0.5, rank=1), 3: Logprob(-1.5, rank=2), 9: Logprob(-4.0, rank=5)}
    assert top_k_of(position, 2) == [(7, -0.5), (3, -1.5)]
    # Under top_k=1 sampling the rest of the vocabulary is masked (-inf): it is no likely token.
    assert top_k_of({7: Logprob(0.0, rank=1), 3: Logprob(float("-inf"), rank=2)}, 2) == [(7, 0.0)]
