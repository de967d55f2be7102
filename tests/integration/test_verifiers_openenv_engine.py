"""verifiers' own OpenEnv environment (`OpenEnvTaskset` + `OpenEnvEnv`, verifiers 0.4), unmodified,
on the real vLLM engine through forge_rl's verifiers adapter, against OpenEnv's echo environment
served on 127.0.0.1 (tests/support/openenv_server.py): offline, no container.

Each turn the environment shows the model a JSON payload (the observation and the action schema),
so the tiny model here spells printable ASCII (a character tokenizer over it) and its context is
long enough for three payloads. Its replies are sampled from the lower-case letters and eos only
(vLLM's `allowed_token_ids`), so each is a valid echo action: the test is about the recording,
not about what an untrained model writes. One engine for the module (10-30 s to start on CPU).
"""

from __future__ import annotations

import asyncio
import functools
import json
import string

import pytest

from forge_rl.engines.config import GeneratorConfig
from forge_rl.envs.renderers import PlainTextRenderer
from forge_rl.envs.rollout import play_episode, trajectory_completion
from forge_rl.envs.runner import EpisodeLimits
from forge_rl.envs.trajectory import ContextSpan, TrajectoryStatus
from forge_rl.models.tiny import TinyModelConfig, create_tiny_model
from forge_rl.tasks.tokenizer import PromptTokenizer
from tests.integration.test_envs_engine import RecordingEngine, as_recorded, turn_prefixes, vllm_turn
from tests.support.openenv_server import PRINTABLE, echo_url  # noqa: F401 (a fixture)

pytestmark = pytest.mark.integration
pytest.importorskip("verifiers.v1", reason="needs verifiers 0.4 (Python >= 3.11; make env-adapters)")

MAX_MODEL_LEN = 4096
PLAYER_MAX_TURNS = 3
LIMITS = EpisodeLimits(max_turns=8, max_total_tokens=MAX_MODEL_LEN, max_tokens_per_turn=10)
CONFIG = GeneratorConfig(max_new_tokens=8, temperature=0.8, top_p=0.9)


@pytest.fixture(scope="module")
def served(echo_url, tmp_path_factory):
    model_dir = create_tiny_model(
        TinyModelConfig(max_position_embeddings=MAX_MODEL_LEN),
        tmp_path_factory.mktemp("ascii") / "model",
        alphabet=PRINTABLE,
    )
    tokenizer = PromptTokenizer(model_dir)
    loop = asyncio.new_event_loop()
    engine = RecordingEngine(CONFIG)
    loop.run_until_complete(engine.start(model_dir, MAX_MODEL_LEN))
    engine.allowed_token_ids = tokenizer.encode_text(string.ascii_lowercase) + [tokenizer.eos_id]
    yield engine, loop, tokenizer
    loop.run_until_complete(engine.shutdown())
    loop.close()


def test_verifiers_openenv_environment_records_exactly_what_vllm_sampled(echo_url, served):
    import verifiers.v1 as vf
    from verifiers.v1.tasksets.openenv import OpenEnvConfig, OpenEnvEnv, OpenEnvEnvConfig

    from forge_rl.envs.verifiers_adapter import verifiers_env_environment

    engine, loop, tokenizer = served
    renderer = PlainTextRenderer(tokenizer)
    config = OpenEnvEnvConfig(
        taskset=OpenEnvConfig(id="openenv", base_url=echo_url), player=vf.AgentConfig(max_turns=PLAYER_MAX_TURNS)
    )
    make_env = verifiers_env_environment(OpenEnvEnv(config))
    generate = functools.partial(engine.generate_turn, eos_id=tokenizer.eos_id)

    async def group():  # a GRPO group: episodes of one task, concurrently
        return await asyncio.gather(*(play_episode(make_env(0, 0), generate, renderer, LIMITS) for _ in range(3)))

    trajectories = loop.run_until_complete(group())
    answered = [(prompt, vllm_turn(final.outputs[0])) for prompt, final in engine.requests]
    assert len(answered) == sum(t.num_turns for t in trajectories)
    for trajectory in trajectories:
        assert trajectory.status == TrajectoryStatus.DONE, trajectory.error
        [sample] = trajectory.samples
        assert 1 <= trajectory.num_turns <= PLAYER_MAX_TURNS
        # Every turn is a request vLLM answered after exactly the tokens before it: ids, logprobs,
        # versions and kept sets as vLLM returned them.
        for span, prefix in zip(trajectory.generated_spans, turn_prefixes(trajectory)):
            answered.remove((prefix, as_recorded(span)))
            assert set(span.policy_versions) == {0}
        # The context is what OpenEnvEnv wrote: the observation after reset, then the echo of each
        # reply; OpenEnv's rewards (0.1 per character, at most 1.0 a step) sum into the final reward.
        contexts = [span for span in sample.spans if isinstance(span, ContextSpan)]
        payloads = [json.loads(renderer.decode(list(span.token_ids))) for span in contexts]
        replies = [renderer.decode(list(span.token_ids)).strip() for span in trajectory.generated_spans]
        echoed = [p["observation"]["echoed_message"] for p in payloads]
        assert echoed == ["Echo Env environment ready!", *replies[: len(payloads) - 1]]
        stepped = [reply for reply in replies if reply] if all(replies) else replies[: replies.index("")]
        assert trajectory.final_reward == pytest.approx(sum(min(0.1 * len(reply), 1.0) for reply in stepped))
        completion = trajectory_completion(trajectory)
        assert completion.token_ids == sample.token_ids and completion.reward == trajectory.final_reward
        assert sum(completion.generated) == sum(len(span.token_ids) for span in trajectory.generated_spans)
    assert not answered
