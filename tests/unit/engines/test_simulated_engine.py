"""The simulated engine (forge_rl/engines/simulated.py) on a virtual clock: its latency model, its
batching, completion lengths, and weight swaps landing mid-request.

Every test runs on `VirtualTimeLoop`, an asyncio loop whose clock jumps to the next timer whenever
nothing is ready, so simulated GPU seconds take no wall time and no result depends on how loaded
the machine is: each expected time below is computed from the latency model, exactly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import statistics

import pytest

from forge_rl.engines.config import GeneratorConfig
from forge_rl.engines.engine import EngineCannot
from forge_rl.engines.simulated import (
    PLACEHOLDER_TOKEN_ID,
    LatencyModel,
    SimEngineConfig,
    SimTrainerConfig,
    SimulatedEngine,
)
from forge_rl.types import CompletionStatus


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on virtual time: when no callback is ready, the clock jumps to the earliest
    timer instead of sleeping. Only for code that waits on timers and futures, never on I/O."""

    def __init__(self):
        super().__init__()
        self._virtual_now = 0.0

    def time(self) -> float:
        return self._virtual_now

    def stall(self, seconds: float) -> None:
        """The process gets no core for `seconds`: the clock moves on, every timer due meanwhile
        fires late."""
        self._virtual_now += seconds

    def _run_once(self) -> None:
        if not self._ready and self._scheduled:
            self._virtual_now = max(self._virtual_now, self._scheduled[0]._when)
        super()._run_once()


def run_virtual(coroutine):
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(coroutine)
    finally:
        # Engines a test did not shut down: their loops end here, not as "Task was destroyed".
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.wait(pending))
        loop.close()


# Round numbers so expected times are easy to read: 10 ms per step, +1 ms per sequence,
# +1 us per context token; 100 us per prefilled token.
LATENCY = LatencyModel(
    decode_step_fixed_s=0.010,
    decode_step_per_sequence_s=0.001,
    decode_step_per_context_token_s=1e-6,
    prefill_per_token_s=1e-4,
)


def sim_config(**sim_changes) -> GeneratorConfig:
    sim = dataclasses.replace(SimEngineConfig(latency=LATENCY, swap_paused_s=0.003, prefetch_s=0.5), **sim_changes)
    return GeneratorConfig(engine="sim", sim=sim, max_new_tokens=1000, max_num_seqs=8)


async def started_engine(config: GeneratorConfig) -> SimulatedEngine:
    engine = SimulatedEngine(config)
    await engine.start(max_model_len=4096)
    return engine


def test_decode_time_is_the_sum_of_steps_over_a_growing_context():
    batch, context, steps = 4, 100, 7
    by_step = sum(LATENCY.step_s(batch, context + j * batch) for j in range(steps))
    assert LATENCY.decode_s(batch, context, steps) == pytest.approx(by_step)
    assert LATENCY.step_s(4, 100) == pytest.approx(0.010 + 0.004 + 0.0001)


@pytest.mark.parametrize("seconds", [0.0, 0.0141, 0.05, 0.3, 12.0])
def test_steps_within_inverts_decode_time(seconds):
    steps = LATENCY.steps_within(4, 100, seconds)
    assert LATENCY.decode_s(4, 100, steps) <= seconds < LATENCY.decode_s(4, 100, steps + 1)


def test_a_lone_request_takes_its_prefill_and_its_decode_steps():
    async def scenario():
        engine = await started_engine(sim_config())
        (completion,) = await engine.generate([1] * 50, 1, eos_id=None, forced_length=20)
        now = asyncio.get_running_loop().time()
        await engine.shutdown()
        return completion, now, engine.num_decode_steps

    completion, now, decode_steps = run_virtual(scenario())
    # The prefill samples the first token; 19 decode steps of batch 1 follow, from 51 tokens of context.
    expected = LATENCY.prefill_s(50) + LATENCY.decode_s(1, 51, 19)
    assert now == pytest.approx(expected)
    assert decode_steps == 19
    assert completion.token_ids == [PLACEHOLDER_TOKEN_ID] * 20
    assert completion.policy_versions == [0] * 20
    assert completion.status == CompletionStatus.TRUNCATED  # forced lengths never end on EOS, as vLLM's


def test_children_of_a_prompt_decode_in_one_batch_and_share_its_prefill():
    async def scenario():
        engine = await started_engine(sim_config())
        completions = await engine.generate([1] * 50, 4, eos_id=None, forced_length=10)
        return completions, asyncio.get_running_loop().time(), engine.num_decode_steps

    completions, now, decode_steps = run_virtual(scenario())
    assert len(completions) == 4 and all(c.num_tokens == 10 for c in completions)
    assert decode_steps == 9  # one batch of 4, not four batches
    assert now == pytest.approx(LATENCY.prefill_s(50) + LATENCY.decode_s(4, 4 * 51, 9))


def test_a_request_arriving_mid_decode_joins_at_the_next_step_boundary():
    async def scenario():
        engine = await started_engine(sim_config(latency=dataclasses.replace(LATENCY, prefill_per_token_s=0.0)))
        first = asyncio.create_task(engine.generate([1], 1, None, forced_length=100))
        await asyncio.sleep(0.0155)  # mid-way through the second step of the first request
        second = await engine.generate([1], 1, None, forced_length=3)
        return second, asyncio.get_running_loop().time(), await first

    second, second_done, first = run_virtual(scenario())
    # First alone: prefill free, step 1 ends at s1, step 2 at s1 + s2 (> 15.5 ms); then both decode.
    s1 = LATENCY.step_s(1, 2)
    s2 = LATENCY.step_s(1, 3)
    assert s1 < 0.0155 < s1 + s2
    joined_at = s1 + s2
    # The second's first token comes with its (free) prefill; two decode steps of batch 2 follow.
    assert second_done == pytest.approx(joined_at + LATENCY.decode_s(2, 4 + 2, 2))
    assert second[0].num_tokens == 3 and first[0].num_tokens == 100


def test_a_process_that_runs_late_costs_the_simulated_gpu_no_decode_steps():
    """Each engine stands for a GPU of its own: while its process waits for a core (every timer
    fires late), decoding goes on. A short and a long request decode together; the process stalls
    across the short one's end. The short one is handed over when the stall ends; the long one
    ends when the latency model says, not late by the stall's overrun."""

    async def scenario():
        loop = asyncio.get_running_loop()
        engine = await started_engine(sim_config())
        short = asyncio.create_task(engine.generate([1] * 50, 1, None, forced_length=5))
        long = asyncio.create_task(engine.generate([1] * 50, 1, None, forced_length=20))
        prefilled = LATENCY.prefill_s(100)
        await asyncio.sleep(prefilled + LATENCY.step_s(2, 102) / 2)  # mid-way through the first step
        stall_ends = loop.time() + LATENCY.decode_s(2, 102, 4)
        loop.stall(LATENCY.decode_s(2, 102, 4))  # past the short one's 4th and last decode step
        await short
        short_at = loop.time()
        await long
        return prefilled, stall_ends, short_at, loop.time(), engine.num_decode_steps

    prefilled, stall_ends, short_at, long_at, decode_steps = run_virtual(scenario())
    assert short_at == pytest.approx(stall_ends)
    # Both prefilled first tokens; 4 decode steps of batch 2, then the long one's 15 alone.
    assert long_at == pytest.approx(prefilled + LATENCY.decode_s(2, 102, 4) + LATENCY.decode_s(1, 55, 15))
    assert decode_steps == 4 + 15


def test_the_batch_never_exceeds_max_num_seqs():
    async def scenario():
        engine = await started_engine(dataclasses.replace(sim_config(), max_num_seqs=2))
        results = await asyncio.gather(*(engine.generate([1], 1, None, forced_length=5) for _ in range(3)))
        return results, asyncio.get_running_loop().time()

    results, now = run_virtual(scenario())
    assert all(r[0].num_tokens == 5 for r in results)
    # Two decode together (each prefilled 1 token); the third waits for them.
    first_two = LATENCY.prefill_s(2) + LATENCY.decode_s(2, 2 * 2, 4)
    assert now == pytest.approx(first_two + LATENCY.prefill_s(1) + LATENCY.decode_s(1, 2, 4))


def test_completion_lengths_are_heavy_tailed_and_cut_at_max_new_tokens():
    config = SimEngineConfig(length_median_tokens=200, length_sigma=1.0)
    rng = random.Random(0)
    lengths = [config.draw_length(rng, 4000) for _ in range(20000)]
    assert statistics.median(lengths) == pytest.approx(200, rel=0.05)
    p99 = sorted(lengths)[int(0.99 * len(lengths))]
    assert p99 == pytest.approx(200 * math.exp(2.326), rel=0.1)  # the log-normal's 99th percentile
    assert max(config.draw_length(rng, 300) for _ in range(1000)) == 300


def test_an_eos_completion_ends_on_eos_and_a_cut_one_is_truncated():
    async def scenario():
        engine = await started_engine(
            dataclasses.replace(sim_config(length_median_tokens=50, length_sigma=2.0), max_new_tokens=100)
        )
        return await engine.generate([1] * 5, 64, eos_id=7)

    completions = run_virtual(scenario())
    for completion in completions:
        if completion.status == CompletionStatus.OK:
            assert completion.token_ids[-1] == 7 and completion.num_tokens < 100
        else:
            assert completion.num_tokens == 100 and 7 not in completion.token_ids
    assert {c.status for c in completions} == {CompletionStatus.OK, CompletionStatus.TRUNCATED}


def test_a_turn_after_a_prefix_is_drawn_within_its_budget_and_the_context():
    from forge_rl.envs.runner import ContextExhausted

    async def scenario():
        engine = await started_engine(sim_config(length_median_tokens=8, length_sigma=1.0))
        turns = [await engine.generate_turn([1] * 100, 12, eos_id=2) for _ in range(40)]
        at_the_edge = await engine.generate_turn([1] * 4090, 1000, eos_id=2)  # 6 tokens of context left
        with pytest.raises(ContextExhausted, match="no room for one more token"):
            await engine.generate_turn([1] * 4096, 4, eos_id=2)
        await engine.shutdown()
        return turns, at_the_edge

    turns, at_the_edge = run_virtual(scenario())
    for turn in turns:
        assert 1 <= len(turn.token_ids) <= 12 and len(turn.logprobs) == len(turn.policy_versions) == len(turn.token_ids)
        # A turn cut at its budget ends "length"; any other ends on eos, as vLLM's would.
        assert (turn.finish_reason, turn.token_ids[-1]) in {("stop", 2), ("length", PLACEHOLDER_TOKEN_ID)}
        assert turn.finish_reason == "stop" or len(turn.token_ids) == 12
    assert {turn.finish_reason for turn in turns} == {"stop", "length"}
    assert len(at_the_edge.token_ids) <= 6


def test_a_keep_swap_lands_between_two_steps_and_later_tokens_carry_the_new_version():
    async def scenario():
        engine = await started_engine(sim_config(latency=dataclasses.replace(LATENCY, prefill_per_token_s=0.0)))
        request = asyncio.create_task(engine.generate([1], 2, None, forced_length=50))
        await asyncio.sleep(0.105)  # mid-step
        swap = await engine.swap_weights(None, 1, "keep")
        return await request, swap

    completions, swap = run_virtual(scenario())
    # Tokens sampled before the swap: the prefill's plus every step finished by 0.105 s and the
    # step in progress then (the pause waits for it).
    done_by_swap = 1 + LATENCY.steps_within(2, 4, 0.105) + 1
    for completion in completions:
        assert completion.policy_versions == [0] * done_by_swap + [1] * (50 - done_by_swap)
    # The stall: the rest of the step in progress, then the configured pause (no recompute).
    step_end = LATENCY.decode_s(2, 4, done_by_swap - 1)
    assert swap.pause_s == pytest.approx(step_end - 0.105)
    assert swap.paused_s == pytest.approx(0.003)
    assert swap.num_requests_over_older_kv == 2


def test_a_recompute_swap_stalls_for_a_prefill_of_everything_in_flight():
    async def scenario():
        engine = await started_engine(sim_config())
        request = asyncio.create_task(engine.generate([1] * 100, 2, None, forced_length=50))
        await asyncio.sleep(0.05)
        swap = await engine.swap_weights(None, 1, "keep", swap_kv="recompute")
        await request
        return swap

    swap = run_virtual(scenario())
    prefill_end = LATENCY.prefill_s(100)  # the children share the prompt's prefill
    decoded = LATENCY.steps_within(2, 2 * 101, 0.05 - prefill_end) + 1  # the step in progress finishes
    context_per_sequence = 100 + 1 + decoded
    assert swap.paused_s == pytest.approx(0.003 + LATENCY.prefill_s(2 * context_per_sequence))
    assert swap.num_requests_over_older_kv == 0


def test_a_wait_swap_lets_requests_in_flight_finish_on_the_old_version_first():
    async def scenario():
        engine = await started_engine(sim_config(latency=dataclasses.replace(LATENCY, prefill_per_token_s=0.0)))
        old = asyncio.create_task(engine.generate([1], 1, None, forced_length=30))
        await asyncio.sleep(0.05)
        swap = asyncio.create_task(engine.swap_weights(None, 1, "wait"))
        await asyncio.sleep(0.01)
        new = asyncio.create_task(engine.generate([1], 1, None, forced_length=5))  # queued by the pause
        return await old, await new, await swap

    old, new, swap = run_virtual(scenario())
    assert old[0].policy_versions == [0] * 30
    assert new[0].policy_versions == [1] * 5
    assert swap.pause_s == pytest.approx(LATENCY.decode_s(1, 2, 29) - 0.05)  # the drain


def test_load_version_prefetches_while_decoding_then_swaps():
    async def scenario():
        engine = await started_engine(sim_config(latency=dataclasses.replace(LATENCY, prefill_per_token_s=0.0)))
        request = asyncio.create_task(engine.generate([1], 1, None, forced_length=100))
        update = await engine.load_version(3)
        return await request, update, engine

    (completion,), update, engine = run_virtual(scenario())
    assert update["policy_version"] == 3 and engine.policy_version == 3
    before = 1 + LATENCY.steps_within(1, 2, 0.5) + 1  # decoding went on through the 0.5 s prefetch
    assert completion.policy_versions == [0] * before + [3] * (100 - before)


def test_the_engine_never_wakes_per_token():
    """Almost no CPU: with a constant batch the loop sleeps until the first sequence finishes."""

    async def scenario():
        engine = await started_engine(sim_config())
        wakeups = 0
        original = engine._decode

        async def counted(*args):
            nonlocal wakeups
            wakeups += 1
            await original(*args)

        engine._decode = counted
        await asyncio.gather(*(engine.generate([1], 1, None, forced_length=length) for length in (200, 400, 800)))
        return wakeups

    assert run_virtual(scenario()) <= 4  # one plan per finishing sequence (+ the arrivals), not 800


def test_simulated_trainer_step_time_grows_with_tokens():
    config = SimTrainerConfig(step_fixed_s=0.5, step_per_token_s=1e-5, time_scale=0.5)
    assert config.step_s(100_000) == pytest.approx((0.5 + 1.0) * 0.5)


@pytest.mark.parametrize(
    ("changes", "flag"),
    [({"length_sigma": -1.0}, "--generator.sim.length-sigma"), ({"time_scale": 0.0}, "--generator.sim.time-scale")],
)
def test_bad_simulation_settings_name_their_flag(changes, flag):
    with pytest.raises(ValueError, match=flag):
        SimEngineConfig(**changes)


def test_a_simulated_generators_process_yields_the_cores_and_a_real_ones_does_not():
    sim = GeneratorConfig(engine="sim")
    assert sim.yields_the_cores
    assert not dataclasses.replace(sim, sim=dataclasses.replace(sim.sim, idle_priority=False)).yields_the_cores
    assert not GeneratorConfig().yields_the_cores
    assert not GeneratorConfig(sim=SimEngineConfig(idle_priority=True)).yields_the_cores  # the real engine


def test_serve_version_loads_the_version_without_opening_a_store():
    async def never_opened():
        raise AssertionError("the simulated trainer publishes no weights: no store to open")

    async def scenario():
        engine = await started_engine(sim_config())
        return await engine.serve_version(2, never_opened, exact=False), engine

    update, engine = run_virtual(scenario())
    assert update["policy_version"] == 2 == engine.policy_version


def test_tokens_in_flight_are_what_the_running_sequences_decoded():
    """Counted at the engine loop's step boundaries: once the short request ends, the long one has
    decoded as many tokens as it did."""

    async def scenario():
        engine = await started_engine(sim_config())
        short = asyncio.create_task(engine.generate([1], 1, None, forced_length=10))
        long = asyncio.create_task(engine.generate([1], 1, None, forced_length=100))
        await short
        in_flight = engine.tokens_in_flight()
        await long
        return in_flight, engine.tokens_in_flight()

    assert run_virtual(scenario()) == (10, 0)


def test_max_new_tokens_bounds_a_request_below_the_generators_budget():
    async def scenario():
        engine = await started_engine(sim_config(length_median_tokens=50.0))
        return await engine.generate([1], 8, None, max_new_tokens=5, temperature=0.3)

    completions = run_virtual(scenario())
    assert all(1 <= len(c.token_ids) <= 5 for c in completions)


@pytest.mark.parametrize(
    "call, setting",
    [
        (lambda e: e.generate_segment([1], None, 2, None, None, 4), "generator.segment_tokens"),
        (lambda e: e.generate_branches([1], [[2]], 2, None, None), "branch rollouts"),
        (lambda e: e.sample([1], None, -1, None), "the service's sampling"),
        (lambda e: e.serve_adapter(None, 1, None), "trainer.lora"),
    ],
)
def test_what_needs_a_model_is_refused_naming_the_setting_and_the_fix(call, setting):
    async def scenario():
        engine = await started_engine(sim_config())
        with pytest.raises(EngineCannot) as refused:
            await call(engine)
        return str(refused.value)

    message = run_virtual(scenario())
    assert setting in message and "--generator.engine vllm" in message
