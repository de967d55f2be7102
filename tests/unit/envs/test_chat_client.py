"""forge_rl/envs/chat_client.py: agent code written against `openai.AsyncOpenAI`, served in process
by a (fake) generator. The trainer sees exactly the ids sampled, each with its version; calls are
grouped by prompt prefix; limits and unsupported fields answer 400; a lost generator propagates."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

openai = pytest.importorskip("openai", reason="the chat client needs the openai package (vLLM installs it)")

from forge_rl.envs.chat_client import ChatAgentEnvironment, ChatSession  # noqa: E402
from forge_rl.envs.renderers import PlainTextRenderer  # noqa: E402
from forge_rl.envs.rollout import EnvWaitClock, TimedEnvironment, play_group, trajectory_completion  # noqa: E402
from forge_rl.envs.runner import ContextExhausted, EpisodeLimits, SampledTurn  # noqa: E402
from forge_rl.envs.trajectory import ContextSpan, GeneratedSpan, TrajectoryStatus  # noqa: E402
from forge_rl.tasks.tokenizer import PromptTokenizer, save_char_tokenizer  # noqa: E402
from tests.support.fakes import FakeGenerate  # noqa: E402
from tests.support.helpers import episode_limits


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> PromptTokenizer:
    model_dir = tmp_path_factory.mktemp("char_tokenizer")
    save_char_tokenizer(model_dir)
    return PromptTokenizer(model_dir)


@pytest.fixture
def renderer(tokenizer) -> PlainTextRenderer:
    return PlainTextRenderer(tokenizer)


def sampled(tokenizer, text: str, version: int = 0, stop: bool = True) -> SampledTurn:
    """A turn as a generator returns it: the text's ids (+ eos when it stopped), distinct logprobs."""
    token_ids = tokenizer.encode_text(text) + ([tokenizer.eos_id] if stop else [])
    logprobs = [-0.1 * (i + 1) for i in range(len(token_ids))]
    return SampledTurn(token_ids, logprobs, [version] * len(token_ids), "stop" if stop else "length")


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def play(agent, generate, renderer, limits=episode_limits()):
    return asyncio.run(ChatAgentEnvironment(agent).play(generate, renderer, limits))


def test_a_multi_turn_agent_is_one_sample_holding_exactly_the_sampled_ids_logprobs_and_versions(tokenizer, renderer):
    turns = [sampled(tokenizer, "C37*52", version=3), sampled(tokenizer, "1924", version=4)]
    generate = FakeGenerate(turns)

    async def agent(client):
        messages = [user("37*52=")]
        first = await client.chat.completions.create(model="policy", messages=messages)
        messages += [{"role": "assistant", "content": first.choices[0].message.content}, user("R1924=")]
        second = await client.chat.completions.create(model="policy", messages=messages)
        return float(second.choices[0].message.content == "1924")

    trajectory = play(agent, generate, renderer)
    assert trajectory.status == TrajectoryStatus.DONE and trajectory.final_reward == 1.0
    [sample] = trajectory.samples
    first_prompt = renderer.render([])[:1] + tokenizer.encode_text("37*52=")
    assert sample.spans == [
        ContextSpan(tuple(first_prompt)),
        GeneratedSpan(tuple(turns[0].token_ids), tuple(turns[0].logprobs), tuple(turns[0].policy_versions)),
        ContextSpan(tuple(tokenizer.encode_text("R1924="))),
        GeneratedSpan(tuple(turns[1].token_ids), tuple(turns[1].logprobs), tuple(turns[1].policy_versions)),
    ]
    # Each call was sampled after exactly the tokens the sample holds before it.
    assert [prefix for prefix, _ in generate.calls] == [first_prompt, sample.token_ids[: -len(turns[1].token_ids)]]
    completion = trajectory_completion(trajectory)
    assert completion.token_ids == sample.token_ids and completion.generated == sample.loss_mask
    assert [v for v, g in zip(completion.policy_versions, completion.generated) if g] == [3] * 7 + [4] * 5


def test_the_reply_carries_text_finish_reason_usage_logprobs_and_the_sampled_ids(tokenizer, renderer):
    turn = sampled(tokenizer, "42", version=7)

    async def agent(client):
        reply = await client.chat.completions.create(model="mine", messages=[user("6*7=")], logprobs=True)
        choice = reply.choices[0]
        assert choice.message.content == "42" and choice.finish_reason == "stop" and reply.model == "mine"
        assert [p.logprob for p in choice.logprobs.content] == turn.logprobs
        assert [p.token for p in choice.logprobs.content] == ["4", "2", ""]
        assert choice.model_extra["token_ids"] == turn.token_ids and choice.model_extra["policy_versions"] == [7, 7, 7]
        assert reply.usage.completion_tokens == 3 and reply.usage.prompt_tokens == 5
        return 1.0

    assert play(agent, FakeGenerate([turn]), renderer).status == TrajectoryStatus.DONE


def test_a_streamed_call_gives_the_same_reply_and_records_the_same_turn(tokenizer, renderer):
    turn = sampled(tokenizer, "42")

    async def agent(client):
        stream = await client.chat.completions.create(
            model="policy", messages=[user("6*7=")], stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == "42" and [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
        assert chunks[-1].usage.completion_tokens == 3
        return 1.0

    trajectory = play(agent, FakeGenerate([turn]), renderer)
    assert trajectory.generated_spans[0].token_ids == tuple(turn.token_ids)


def test_a_call_that_does_not_extend_an_earlier_one_starts_a_new_sample(tokenizer, renderer):
    turns = [sampled(tokenizer, "A"), sampled(tokenizer, "B"), sampled(tokenizer, "C")]
    generate = FakeGenerate(turns)

    async def agent(client):
        await client.chat.completions.create(model="p", messages=[user("X=")])
        # A fresh conversation (a sub-agent, an edited history): not a continuation.
        await client.chat.completions.create(model="p", messages=[user("Y=")])
        # Continues the first: its prompt starts with the first call's prompt and completion.
        await client.chat.completions.create(
            model="p", messages=[user("X="), {"role": "assistant", "content": "A"}, user("Z")]
        )
        return 0.5

    trajectory = play(agent, generate, renderer)
    assert [len(s.generated_spans) for s in trajectory.samples] == [2, 1]
    first, second = trajectory.samples
    assert first.generated_spans[1].token_ids == tuple(turns[2].token_ids)
    assert second.generated_spans[0].token_ids == tuple(turns[1].token_ids)
    assert trajectory.num_turns == 3 and trajectory.num_forks == 1


def test_history_that_renders_differently_from_what_was_sampled_forks_instead_of_training_on_unsampled_tokens(
    tokenizer, renderer
):
    # The model stopped at its budget ("length": no eos), and the agent sends its text back with
    # a different ending: the rendering no longer starts with the sampled ids.
    turns = [sampled(tokenizer, "AB"), sampled(tokenizer, "C")]

    async def agent(client):
        await client.chat.completions.create(model="p", messages=[user("Q=")])
        await client.chat.completions.create(
            model="p", messages=[user("Q="), {"role": "assistant", "content": "AX"}, user("R")]
        )
        return 0.0

    trajectory = play(agent, FakeGenerate(turns), renderer)
    assert len(trajectory.samples) == 2
    assert [span.token_ids for span in trajectory.generated_spans] == [tuple(t.token_ids) for t in turns]
    assert all(isinstance(span, ContextSpan) for span in trajectory.samples[1].spans[:-1])


def test_a_call_past_max_turns_is_a_400_naming_the_limit_and_the_episode_ends_truncated(tokenizer, renderer):
    async def agent(client):
        messages = [user("Q=")]
        for _ in range(3):
            reply = await client.chat.completions.create(model="p", messages=messages)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content}, user("M")]
        return 1.0

    errors = []

    async def recording_agent(client):
        try:
            return await agent(client)
        except openai.BadRequestError as e:
            errors.append(e)
            raise

    trajectory = play(
        recording_agent, FakeGenerate([sampled(tokenizer, "A")] * 2), renderer, episode_limits(max_turns=2)
    )
    assert trajectory.status == TrajectoryStatus.TRUNCATED_TURNS and trajectory.final_reward == 0.0
    assert errors[0].status_code == 400 and "max_turns (2)" in str(errors[0])
    assert trajectory.num_turns == 2


def test_a_prompt_with_no_room_left_is_a_400_context_length_exceeded_and_the_episode_truncated(tokenizer, renderer):
    async def agent(client):
        try:
            await client.chat.completions.create(model="p", messages=[user("1234567890")])
        except openai.BadRequestError as e:
            assert e.code == "context_length_exceeded" and "max_total_tokens (8)" in str(e)
            return 1.0  # the agent carries on: its reward is not used after a limit
        raise AssertionError("expected a 400")

    trajectory = play(agent, FakeGenerate([]), renderer, episode_limits(max_total_tokens=8))
    assert trajectory.status == TrajectoryStatus.TRUNCATED_TOKENS and trajectory.final_reward == 0.0


def test_each_turn_is_budgeted_by_max_tokens_per_turn_the_request_and_the_room_left(tokenizer, renderer):
    generate = FakeGenerate([sampled(tokenizer, "ABCDEF", stop=False), sampled(tokenizer, "A")])

    async def agent(client):
        await client.chat.completions.create(model="p", messages=[user("Q=")], max_tokens=3)
        await client.chat.completions.create(model="p", messages=[user("Q=")])
        return 1.0

    play(agent, generate, renderer, EpisodeLimits(max_total_tokens=10, max_tokens_per_turn=5))
    assert [budget for _, budget in generate.calls] == [3, 5]


def test_the_generators_full_context_is_a_400_and_the_episode_truncated(tokenizer, renderer):
    async def full(prefix, max_new_tokens):
        raise ContextExhausted("the generator's context (128) is full")

    async def agent(client):
        with pytest.raises(openai.BadRequestError, match="context .128. is full"):
            await client.chat.completions.create(model="p", messages=[user("Q=")])
        return 1.0

    assert play(agent, full, renderer).status == TrajectoryStatus.TRUNCATED_TOKENS


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 2),
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("temperature", 0.7),
        ("stop", ["\n"]),
        ("top_logprobs", 5),
    ],
)
def test_a_field_the_generator_cannot_honour_is_refused_with_a_400_naming_it(tokenizer, renderer, field, value):
    async def agent(client):
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model="p", messages=[user("Q=")], **{field: value})
        assert refused.value.param == field and field in str(refused.value)
        reply = await client.chat.completions.create(model="p", messages=[user("Q=")])
        return float(reply.choices[0].message.content == "A")

    trajectory = play(agent, FakeGenerate([sampled(tokenizer, "A")]), renderer)
    assert trajectory.status == TrajectoryStatus.DONE and trajectory.num_turns == 1


def test_an_agent_that_raises_ends_its_episode_errored_and_one_that_never_calls_too(tokenizer, renderer):
    async def raises(client):
        await client.chat.completions.create(model="p", messages=[user("Q=")])
        raise KeyError("boom")

    async def silent(client):
        return 1.0

    errored = play(raises, FakeGenerate([sampled(tokenizer, "A")]), renderer)
    assert errored.status == TrajectoryStatus.ENV_ERROR and "KeyError" in errored.error
    assert not errored.status.trainable
    assert play(silent, FakeGenerate([]), renderer).status == TrajectoryStatus.ENV_ERROR


def test_an_agent_that_hangs_between_calls_ends_env_timeout(tokenizer, renderer):
    async def hangs(client):
        await client.chat.completions.create(model="p", messages=[user("Q=")])
        await asyncio.Event().wait()

    trajectory = play(hangs, FakeGenerate([sampled(tokenizer, "A")]), renderer, episode_limits(env_step_timeout_s=0.05))
    assert trajectory.status == TrajectoryStatus.ENV_TIMEOUT and trajectory.num_turns == 1


def test_a_slow_turn_is_not_the_agents_time(tokenizer, renderer):
    async def slow(prefix, max_new_tokens):
        await asyncio.sleep(1.0)  # the generator decoding, longer than the agent may take between calls
        return sampled(tokenizer, "A")

    async def agent(client):
        await client.chat.completions.create(model="p", messages=[user("Q=")])
        return 1.0

    # The agent's own time around its one call is milliseconds; 0.5 s leaves a loaded machine room.
    assert play(agent, slow, renderer, episode_limits(env_step_timeout_s=0.5)).status == TrajectoryStatus.DONE


def test_a_lost_generator_propagates_out_of_the_episode(tokenizer, renderer):
    class GeneratorGone(Exception):
        pass

    async def lost(prefix, max_new_tokens):
        raise GeneratorGone("generator0 died")

    async def agent(client):
        try:
            await client.chat.completions.create(model="p", messages=[user("Q=")])
        except openai.APIStatusError:
            pass  # an agent that swallows errors cannot hide the loss
        return 1.0

    with pytest.raises(GeneratorGone):
        play(agent, lost, renderer)


def test_a_broken_generate_is_raised_not_answered(tokenizer, renderer):
    async def broken(prefix, max_new_tokens):
        return SampledTurn([5, 6], [-0.1], [0, 0], "stop")  # one logprob for two tokens

    async def agent(client):
        with pytest.raises(openai.APIStatusError):
            await client.chat.completions.create(model="p", messages=[user("Q=")])
        return 1.0

    with pytest.raises(ValueError, match="must agree"):
        play(agent, broken, renderer)


def test_the_rollout_plays_agent_environments_in_a_group_and_times_them_as_environment_calls(tokenizer, renderer):
    async def agent(client):
        reply = await client.chat.completions.create(model="p", messages=[user("Q=")])
        return float(reply.choices[0].message.content == "A")

    clock = EnvWaitClock(1)
    envs = [TimedEnvironment(ChatAgentEnvironment(agent), clock, 0) for _ in range(2)]
    generate = FakeGenerate([sampled(tokenizer, "A"), sampled(tokenizer, "B")])
    trajectories = [
        graph.agents["agent"] for graph in asyncio.run(play_group(envs, generate, renderer, episode_limits()))
    ]
    assert sorted(t.final_reward for t in trajectories) == [0.0, 1.0]
    assert all(t.status == TrajectoryStatus.DONE for t in trajectories)


def test_a_direct_session_serves_without_an_agent_environment(tokenizer, renderer):
    async def main():
        session = ChatSession(FakeGenerate([sampled(tokenizer, "7")]), renderer, episode_limits())
        client = session.client()
        models = await client.models.list()
        reply = await client.chat.completions.create(model=models.data[0].id, messages=[user("3+4=")])
        await client.close()
        return reply, session

    reply, session = asyncio.run(main())
    assert reply.choices[0].message.content == "7" and session.recorder.num_calls == 1


def test_the_agent_example_of_the_docs_runs(capsys):
    page = (Path(__file__).resolve().parents[3] / "docs" / "environments.md").read_text()
    blocks = [piece.split("```")[0] for piece in page.split("```python\n")[1:]]
    [code] = [block for block in blocks if "ChatAgentEnvironment" in block]
    exec(compile(code, "docs/environments.md", "exec"), {"__name__": "docs_example"})
    assert capsys.readouterr().out == "done 1 2 1.0\n"
