"""Multi-turn episodes (forge_rl/envs/runner.py) on the real vLLM engine: `VLLMEngine.generate_turn`
serving a tiny random Llama.

One engine serves the module (10-30 s to start on CPU), on the module's event loop. The model is
untrained, so its turns are noise: the tests assert the invariants (the trainer sees exactly the
ids vLLM sampled, turn after turn; context is exactly the rendered observations; each token keeps
the version that sampled it), statuses and limits, never a reward. `RecordingEngine` keeps every
request vLLM answered, prompt and output, as the witness of what was sampled.

The weight-swap tests change the engine's weights and run last (pytest keeps file order). They hold
a turn mid-decode by construction (tests/support/held_engine.py), not by timing. The last one
plays the rollout loop's path (forge_rl/envs/rollout.py) into the buffer and the trainer's batch.
"""

from __future__ import annotations

import asyncio
import functools
import math
from pathlib import Path

import pytest
import torch

from forge_rl.core.batching import make_train_batch
from forge_rl.core.buffer import BufferConfig, ReplayBuffer
from forge_rl.engines.config import GeneratorConfig
from forge_rl.envs.calculator import make_calculator_env
from forge_rl.envs.renderers import PlainTextRenderer
from forge_rl.envs.rollout import play_group, trajectory_completion
from forge_rl.envs.runner import EpisodeLimits, run_episode
from forge_rl.envs.trajectory import ContextSpan, GeneratedSpan, Trajectory, TrajectoryStatus
from forge_rl.models.tiny import TinyModelConfig, create_tiny_model
from forge_rl.tasks.tokenizer import ALPHABET, PromptTokenizer
from forge_rl.types import Episode
from tests.support.held_engine import HOLD_PROMPT, HoldableEngine, hold_mid_request
from tests.support.helpers import episode_limits

pytestmark = pytest.mark.integration

MAX_MODEL_LEN = 128
KV_BLOCK_SIZE = 32
"""Small enough that the tiny model's episodes fill whole blocks (CPU's default, 128, never would)."""
# temperature != 1 and top_p < 1: each turn's behaviour logprobs are those of the distribution it
# was drawn from (scaled, renormalized over the kept set each token records), checked against
# transformers after the swap. max_new_tokens bounds the single-turn path only; turns get theirs
# from EpisodeLimits.
CONFIG = GeneratorConfig(max_new_tokens=8, temperature=0.8, top_p=0.9, kv_block_size=KV_BLOCK_SIZE)
LIMITS = EpisodeLimits(max_turns=4, max_total_tokens=MAX_MODEL_LEN, max_tokens_per_turn=12, max_malformed_turns=4)
"""Up to 4 turns of noise: as many malformed turns as turns, so the calculator answers each."""
LOGPROB_ATOL = 1e-3


class RecordingEngine(HoldableEngine):
    """Records each request vLLM answered: the prompt ids sent and vLLM's final output. A test may
    restrict sampling to `allowed_token_ids` (vLLM's own sampling parameter)."""

    def __init__(self, config: GeneratorConfig):
        super().__init__(config)
        self.requests: list[tuple[list[int], object]] = []
        self.allowed_token_ids: list[int] | None = None

    def _sampling_params(self, *args):
        params = super()._sampling_params(*args)
        params.allowed_token_ids = self.allowed_token_ids
        return params

    async def _request(self, prompt_token_ids, params):
        final, version = await super()._request(prompt_token_ids, params)
        if list(prompt_token_ids) != HOLD_PROMPT:  # the holder is the test's, not an episode's
            self.requests.append((list(prompt_token_ids), final))
        return final, version


class Served:
    def __init__(self, engine: RecordingEngine, loop: asyncio.AbstractEventLoop, model_dir: Path):
        self.engine = engine
        self.loop = loop
        self.model_dir = model_dir
        self.tokenizer = PromptTokenizer(model_dir)
        self.renderer = PlainTextRenderer(self.tokenizer)

    def run(self, coroutine):
        return self.loop.run_until_complete(coroutine)

    def play(self, env, limits: EpisodeLimits, generate=None) -> Trajectory:
        generate = generate or functools.partial(self.engine.generate_turn, eos_id=self.tokenizer.eos_id)
        return self.run(run_episode(env, generate, self.renderer, limits))


@pytest.fixture(scope="module")
def served(model_dir):
    loop = asyncio.new_event_loop()
    engine = RecordingEngine(CONFIG)
    loop.run_until_complete(engine.start(model_dir, MAX_MODEL_LEN))
    yield Served(engine, loop, model_dir)
    loop.run_until_complete(engine.shutdown())
    loop.close()


def sampled_by_vllm(served: Served, prefix: list[int]):
    """vLLM's output for the one recorded request sent with exactly `prefix`."""
    [output] = [final.outputs[0] for prompt, final in served.engine.requests if prompt == prefix]
    return output


def vllm_turn(output) -> tuple[list[int], list[float], list[int], list[set[int]]]:
    """Ids, logprobs, per-token versions and kept sets as vLLM returned them, read from its output
    directly (kept: the returned top logprobs not filtered to -inf; the tiny vocabulary fits them all)."""
    versions = [int(span.version) for span in output.weight_versions for _ in range(span.start, span.end)]
    logprobs = [position[token].logprob for token, position in zip(output.token_ids, output.logprobs)]
    kept = [{t for t, lp in position.items() if lp.logprob > -math.inf} for position in output.logprobs]
    return list(output.token_ids), logprobs, versions, kept


def as_recorded(span: GeneratedSpan) -> tuple[list[int], list[float], list[int], list[set[int]]]:
    return (
        list(span.token_ids),
        list(span.logprobs),
        list(span.policy_versions),
        [set(k) for k in span.sampling_support],
    )


def turn_prefixes(trajectory: Trajectory) -> list[list[int]]:
    """For each generated span, in order: the tokens of its sample before it (what it was sampled after)."""
    prefixes = []
    for sample in trajectory.samples:
        position = 0
        for span in sample.spans:
            if isinstance(span, GeneratedSpan):
                prefixes.append(sample.token_ids[:position])
            position += len(span.token_ids)
    return prefixes


def check_context_is_the_rendered_observations(served: Served, trajectory: Trajectory) -> None:
    """The j-th context span ends where its sample reads exactly the rendering of the conversation
    up to the j-th observation (conversation: observation, turn, observation, ...)."""
    num_context_spans = 0
    for sample in trajectory.samples:
        position = 0
        for span in sample.spans:
            position += len(span.token_ids)
            if isinstance(span, ContextSpan):
                rendered = served.renderer.render(trajectory.conversation[: 2 * num_context_spans + 1])
                assert sample.token_ids[:position] == rendered
                num_context_spans += 1
    assert num_context_spans == (len(trajectory.conversation) + 1) // 2  # every observation is in


def test_calculator_episodes_carry_exactly_the_tokens_vllm_sampled_turn_after_turn(served):
    envs = [make_calculator_env(seed=0, index=i) for i in range(8)]
    generate = functools.partial(served.engine.generate_turn, eos_id=served.tokenizer.eos_id)
    num_requests_before = len(served.engine.requests)

    async def play_concurrently():  # environments step while other episodes decode
        return await asyncio.gather(*(run_episode(env, generate, served.renderer, LIMITS) for env in envs))

    trajectories = served.run(play_concurrently())

    assert len(served.engine.requests) - num_requests_before == sum(t.num_turns for t in trajectories)
    assert sum(t.num_turns for t in trajectories) > len(trajectories)  # multi-turn, not one turn each
    for trajectory in trajectories:
        # Noise never closes with the product; the model's own failures are trainable, none errored.
        assert trajectory.status in {
            TrajectoryStatus.DONE,
            TrajectoryStatus.TRUNCATED_TURNS,
            TrajectoryStatus.TRUNCATED_TOKENS,
        }
        assert 1 <= trajectory.num_turns <= LIMITS.max_turns
        assert all(sample.num_tokens <= LIMITS.max_total_tokens for sample in trajectory.samples)
        spans = trajectory.generated_spans
        assert len(spans) == trajectory.num_turns
        for span, prefix in zip(spans, turn_prefixes(trajectory)):
            # Sampled after exactly the tokens the trainer sees before it; ids, logprobs and versions
            # exactly as vLLM returned them.
            assert as_recorded(span) == vllm_turn(sampled_by_vllm(served, prefix))
            ids, versions = list(span.token_ids), list(span.policy_versions)
            assert versions == [0] * len(ids)
            assert len(ids) <= LIMITS.max_tokens_per_turn
            assert ids[-1] == served.tokenizer.eos_id or len(ids) == LIMITS.max_tokens_per_turn
        check_context_is_the_rendered_observations(served, trajectory)
        assert trajectory.oldest_policy_version == 0


def test_later_turns_reuse_the_earlier_turns_kv_from_the_prefix_cache(served):
    """Each turn's request finds the whole blocks of the previous turn's sequence in vLLM's
    prefix cache (same version, same salt): earlier turns are not prefilled again."""
    generate = functools.partial(served.engine.generate_turn, eos_id=None)  # full-length turns: long prefixes
    num_requests_before = len(served.engine.requests)
    trajectory = served.play(make_calculator_env(seed=1, index=0), LIMITS, generate)

    requests = served.engine.requests[num_requests_before:]
    assert trajectory.num_turns == len(requests) >= 3
    for (previous_prompt, previous), (prompt, final) in zip(requests, requests[1:]):
        previous_sequence = previous_prompt + list(previous.outputs[0].token_ids)
        if prompt[: len(previous_sequence)] != previous_sequence:
            continue  # the trajectory forked here (the model sampled a special token): a new sequence
        # vLLM caches whole blocks of tokens it has computed (the last sampled one never was) and
        # always computes a prompt's last token itself.
        computed = len(previous_sequence) - 1
        expected = min(computed, len(prompt) - 1) // KV_BLOCK_SIZE * KV_BLOCK_SIZE
        assert final.num_cached_tokens == expected
    assert sum(final.num_cached_tokens for _, final in requests) > 0


def test_a_prefix_longer_than_the_context_ends_the_episode_truncated_before_reaching_vllm(served):
    class LongPromptEnv:
        async def reset(self):
            return "7" * MAX_MODEL_LEN  # fits max_total_tokens (4096), not the engine's context

        async def step(self, turn_text):
            raise AssertionError("no turn can be sampled")

    num_requests_before = len(served.engine.requests)
    trajectory = served.play(LongPromptEnv(), episode_limits(max_total_tokens=4096))

    assert trajectory.status == TrajectoryStatus.TRUNCATED_TOKENS and trajectory.num_turns == 0
    assert "prefix has 129 tokens" in trajectory.error and "max_model_len) is 128" in trajectory.error
    assert len(served.engine.requests) == num_requests_before  # refused before anything was sent


def test_an_episode_that_outgrows_the_context_is_cut_at_it_then_truncated(served):
    """max_total_tokens beyond the engine's context: the turn that reaches max_model_len is cut
    there ("length"), the environment answers it, and the next turn finds no room."""
    limits = EpisodeLimits(max_turns=20, max_total_tokens=4096, max_tokens_per_turn=40, max_malformed_turns=20)
    generate = functools.partial(served.engine.generate_turn, eos_id=None)  # every turn takes its budget
    num_requests_before = len(served.engine.requests)
    trajectory = served.play(make_calculator_env(seed=2, index=0), limits, generate)

    assert trajectory.status == TrajectoryStatus.TRUNCATED_TOKENS
    assert f"turn {trajectory.num_turns + 1}:" in trajectory.error and "max_model_len" in trajectory.error
    requests = served.engine.requests[num_requests_before:]
    assert len(requests) == trajectory.num_turns >= 2
    for prompt, final in requests:
        assert len(prompt) + len(final.outputs[0].token_ids) <= MAX_MODEL_LEN
    *_, (last_prompt, last) = requests
    assert len(last_prompt) + len(last.outputs[0].token_ids) == MAX_MODEL_LEN  # cut at the context


def test_openenv_verifiers_and_chat_client_agents_record_exactly_what_vllm_sampled(served):
    """The adapters on the real engine: OpenEnv's echo environment (reset/step), a verifiers task
    played by verifiers' own chat program, and an agent of three calls written against
    openai.AsyncOpenAI (forge_rl/envs/chat_client.py), concurrently. Every call is a request vLLM
    answered after exactly the tokens its sample holds before it, recorded as vLLM returned it."""
    pytest.importorskip("openenv.core.env_server.interfaces", reason="needs openenv (make env-adapters)")
    pytest.importorskip("verifiers.v1", reason="needs verifiers 0.4 (Python >= 3.11; make env-adapters)")
    from forge_rl.envs.chat_client import ChatAgentEnvironment
    from forge_rl.envs.openenv_adapter import openenv_echo_env
    from forge_rl.envs.rollout import play_episode
    from forge_rl.envs.verifiers_sums import sums_environment

    async def three_calls(client):
        messages = [{"role": "user", "content": "37*52="}]
        for answer in ("R1=", "R2="):
            reply = await client.chat.completions.create(model="policy", messages=messages)
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content},
                {"role": "user", "content": answer},
            ]
        await client.chat.completions.create(model="policy", messages=messages)
        return 0.5

    envs = [openenv_echo_env(0, i) for i in range(2)] + [sums_environment(0, i) for i in range(2)]
    envs += [ChatAgentEnvironment(three_calls) for _ in range(2)]
    generate = functools.partial(served.engine.generate_turn, eos_id=served.tokenizer.eos_id)
    num_requests_before = len(served.engine.requests)

    async def play_concurrently():
        return await asyncio.gather(*(play_episode(env, generate, served.renderer, LIMITS) for env in envs))

    trajectories = served.run(play_concurrently())
    # Episodes may send the same prefix (both echo episodes start alike): match each recorded turn
    # to one request vLLM answered, each request used once.
    answered = [(prompt, vllm_turn(final.outputs[0])) for prompt, final in served.engine.requests[num_requests_before:]]
    assert len(answered) == sum(t.num_turns for t in trajectories)
    assert [t.num_turns for t in trajectories] == [3, 3, 1, 1, 3, 3]
    for trajectory in trajectories:
        assert trajectory.status == TrajectoryStatus.DONE, trajectory.error
        for span, prefix in zip(trajectory.generated_spans, turn_prefixes(trajectory)):
            answered.remove((prefix, as_recorded(span)))  # ValueError: recorded something vLLM did not sample there
        completion = trajectory_completion(trajectory)
        assert completion.token_ids == trajectory.samples[0].token_ids
        assert completion.reward == trajectory.final_reward
        assert len(trajectory.generated_spans) == trajectory.num_turns
    # An agent's calls continue one sample, except after a turn whose text does not render back to
    # its ids (the model sampled a special token inside it): there the next call starts a new one.
    for trajectory in trajectories[4:]:
        breaks = [not reads_back(served, span.token_ids) for span in trajectory.generated_spans[:-1]]
        assert len(trajectory.samples) == 1 + sum(breaks)


def reads_back(served: Served, token_ids: tuple[int, ...]) -> bool:
    """Whether a plain-format assistant turn renders back to its sampled ids (eos closes it)."""
    text_ids = served.tokenizer.encode_text(served.tokenizer.decode(list(token_ids)))
    return list(token_ids) in (text_ids, text_ids + [served.tokenizer.eos_id])


def hf_logprobs(model_dir: Path, prefix: list[int], span: GeneratedSpan) -> list[float]:
    """log_softmax(logits / temperature) of the span's tokens under `transformers`, fp32, over each
    token's recorded kept set (top-p)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prefix + list(span.token_ids)])).logits[0, len(prefix) - 1 : -1]
    logits = logits / CONFIG.temperature
    return [
        (logits_V[token] - torch.logsumexp(logits_V[list(kept)], dim=0)).item()
        for logits_V, token, kept in zip(logits, span.token_ids, span.sampling_support)
    ]


def swapping_during_turn_2(engine, new_dir: Path, new_version: int, hold_after_tokens: int):
    """A `generate` whose turns run their whole budget (eos ignored) and whose second turn is held
    after `hold_after_tokens` tokens, swapped to `new_version` (staged already; keep mode), resumed."""
    num_turns_started = 0

    async def generate(prefix, max_new_tokens):
        nonlocal num_turns_started
        num_turns_started += 1
        if num_turns_started == 2:
            turn = await hold_mid_request(
                engine, lambda: engine.generate_turn(prefix, max_new_tokens, eos_id=None), 1, hold_after_tokens
            )
            await engine.swap_weights(new_dir, new_version, mode="keep")
            return await turn
        return await engine.generate_turn(prefix, max_new_tokens, eos_id=None)

    return generate


def test_an_episode_spanning_a_weight_swap_keeps_the_version_of_every_token(served, tmp_path_factory):
    """Turn 1 on version 0; turn 2 held after HOLD_AFTER_TOKENS tokens, swapped to version 1 (keep
    mode), resumed; turn 3 sampled after the swap, its prefix encoded by version 1."""
    hold_after_tokens, turn_tokens = 4, 10
    new_dir = create_tiny_model(TinyModelConfig(seed=1), tmp_path_factory.mktemp("model_v1"))
    engine = served.engine
    served.run(engine.stage_weights(new_dir, 1))  # the swap itself is then a reference swap
    generate = swapping_during_turn_2(engine, new_dir, 1, hold_after_tokens)

    limits = EpisodeLimits(
        max_turns=3, max_total_tokens=MAX_MODEL_LEN, max_tokens_per_turn=turn_tokens, max_malformed_turns=3
    )
    trajectory = served.play(make_calculator_env(seed=3, index=0), limits, generate)

    assert trajectory.status == TrajectoryStatus.TRUNCATED_TURNS and trajectory.num_turns == 3
    spans = trajectory.generated_spans
    assert [list(span.policy_versions) for span in spans] == [
        [0] * turn_tokens,
        [0] * hold_after_tokens + [1] * (turn_tokens - hold_after_tokens),
        [1] * turn_tokens,
    ]
    # What max_policy_age is enforced on: the oldest trainable token, not the newest.
    assert trajectory.oldest_policy_version == 0
    prefixes = turn_prefixes(trajectory)
    for span, prefix in zip(spans, prefixes):
        assert as_recorded(span) == vllm_turn(sampled_by_vllm(served, prefix))
    # Turn 3 reused no block cached under version 0 (requests are salted by version): its whole
    # prefix was encoded by version 1, so its logprobs are exactly version 1's.
    [third_final] = [final for prompt, final in engine.requests if prompt == prefixes[2]]
    assert len(prefixes[2]) > KV_BLOCK_SIZE and third_final.num_cached_tokens == 0
    assert list(spans[2].logprobs) == pytest.approx(hf_logprobs(new_dir, prefixes[2], spans[2]), abs=LOGPROB_ATOL)


def test_a_turn_aborted_by_an_abort_mode_swap_is_resubmitted_and_joined(served, tmp_path_factory):
    """swap_mode "abort": the held turn is aborted after HOLD tokens; generate_turn resubmits prefix +
    those tokens and joins the rest, sampled by the new version, into one turn."""
    hold_after_tokens, turn_tokens = 4, 10
    new_dir = create_tiny_model(TinyModelConfig(seed=2), tmp_path_factory.mktemp("model_v2"))
    engine = served.engine
    old_version, new_version = engine.policy_version, engine.policy_version + 1
    served.run(engine.stage_weights(new_dir, new_version))

    async def generate(prefix, max_new_tokens):
        turn = await hold_mid_request(
            engine, lambda: engine.generate_turn(prefix, max_new_tokens, eos_id=None), 1, hold_after_tokens
        )
        await engine.swap_weights(new_dir, new_version, mode="abort")
        return await turn

    limits = EpisodeLimits(max_turns=1, max_total_tokens=MAX_MODEL_LEN, max_tokens_per_turn=turn_tokens)
    num_requests_before = len(engine.requests)
    trajectory = served.play(make_calculator_env(seed=4, index=0), limits, generate)

    [span] = trajectory.generated_spans
    assert list(span.policy_versions) == [old_version] * hold_after_tokens + [new_version] * (
        turn_tokens - hold_after_tokens
    )
    (first_prompt, aborted), (second_prompt, rest) = engine.requests[num_requests_before:]
    assert aborted.outputs[0].finish_reason == "abort"
    assert second_prompt == first_prompt + list(span.token_ids[:hold_after_tokens])  # resubmitted as sampled
    assert list(span.token_ids) == list(aborted.outputs[0].token_ids) + list(rest.outputs[0].token_ids)


def test_the_library_rollout_across_a_weight_update_trains_exactly_the_sampled_ids_within_the_age_bound(
    served, tmp_path_factory
):
    """What the rollout loop does with an environment (forge_rl/envs/rollout.py: play_group, then
    one completion per trajectory), on the real engine, then the buffer's age bound and the trainer's
    batch: turn 2 is held mid-decode and swapped to a new version (keep mode)."""
    hold_after_tokens, turn_tokens = 4, 10
    engine = served.engine
    old_version, new_version = engine.policy_version, engine.policy_version + 1
    new_dir = create_tiny_model(TinyModelConfig(seed=5), tmp_path_factory.mktemp("model_v3"))
    served.run(engine.stage_weights(new_dir, new_version))
    generate = swapping_during_turn_2(engine, new_dir, new_version, hold_after_tokens)

    limits = EpisodeLimits(
        max_turns=3, max_total_tokens=MAX_MODEL_LEN, max_tokens_per_turn=turn_tokens, max_malformed_turns=3
    )
    # The held turn ignores eos, so every turn here is cut at its budget, and the plain format
    # (which closes a turn with eos) would fork the trajectory at each one, as would a special token
    # sampled inside a turn (it decodes to nothing). So: turns of the alphabet only, rendered
    # unclosed; then the trajectory is one sample, and the trainer's row holds all three turns.
    engine.allowed_token_ids = served.tokenizer.encode_text(ALPHABET)
    try:
        [graph] = served.run(
            play_group(
                [make_calculator_env(seed=5, index=0)], generate, UnclosedTurnsRenderer(served.tokenizer), limits
            )
        )
    finally:
        engine.allowed_token_ids = None
    trajectory = graph.agents["agent"]
    assert len(trajectory.samples) == 1
    completion = trajectory_completion(trajectory)

    # Each generated run of the trainer's row is a turn exactly as vLLM sampled it, after exactly
    # the tokens before it in that row; context (prompt, observations) is never in the loss.
    batch = make_train_batch([Episode(0, "", "", [], [completion])], pad_id=served.tokenizer.pad_id)
    row = batch.input_ids_NL[0].tolist()
    assert row == completion.token_ids and batch.loss_mask_NL[0].tolist() == completion.generated
    runs = [
        (start, start + len(span.token_ids)) for start, span in zip(turn_starts(completion), trajectory.generated_spans)
    ]
    assert len(runs) == trajectory.num_turns == 3
    sampled_versions = []
    for start, end in runs:
        ids, logprobs, versions, _ = vllm_turn(sampled_by_vllm(served, row[:start]))
        assert row[start:end] == ids and completion.policy_versions[start:end] == versions
        assert batch.behaviour_logprobs_NL[0, start:end].tolist() == pytest.approx(logprobs, abs=1e-6)
        sampled_versions.append(versions)
    assert sampled_versions == [
        [old_version] * turn_tokens,
        [old_version] * hold_after_tokens + [new_version] * (turn_tokens - hold_after_tokens),
        [new_version] * turn_tokens,
    ]
    assert completion.oldest_policy_version == old_version

    # The age bound reads the oldest generated token: at max_policy_age 0 and trainer version
    # new_version, every token of the old version leaves the loss (mask_tokens) or the episode is
    # dropped (drop_episode); at age 1 all of it trains.
    def trained_versions(**buffer):
        replay = ReplayBuffer(BufferConfig(capacity_episodes=2, **buffer))
        replay.put(Episode(0, "", "", [], [completion]), trainer_version=new_version)
        sampled = replay.sample(1, trainer_version=new_version)
        if sampled is None:
            return None
        [trained] = sampled[0].completions
        return {v for v, trains in zip(trained.policy_versions, trained.loss_mask) if trains}

    assert trained_versions(max_policy_age=0, drop_policy="mask_tokens") == {new_version}
    assert trained_versions(max_policy_age=0, drop_policy="drop_episode") is None
    assert trained_versions(max_policy_age=1) == {old_version, new_version}


class UnclosedTurnsRenderer(PlainTextRenderer):
    """The plain format without the eos that closes each assistant turn: for turns cut at their budget."""

    def render(self, conversation):
        return [self.tokenizer.bos_id] + [
            t for message in conversation for t in self.tokenizer.encode_text(message.content)
        ]


def turn_starts(completion) -> list[int]:
    """Where each run of generated tokens starts in the completion's sequence."""
    mask = completion.generated
    return [i for i, generated in enumerate(mask) if generated and (i == 0 or not mask[i - 1])]
