"""The supervised warm-up (forge_rl/training/warmup.py) on demonstrations (forge_rl/envs/demonstrations.py):
it trains exactly the token layout RL samples and trains, on the generated tokens only."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
import torch

from forge_rl.config import GRPOConfig
from forge_rl.envs.calculator import CalculatorEnv, make_calculator_env, make_calculator_env_without_tool
from forge_rl.envs.demonstrations import WarmupConfig, demonstration_sample
from forge_rl.envs.environment import MalformedTurn
from forge_rl.envs.renderers import PlainTextRenderer
from forge_rl.envs.rollout import EnvironmentConfig
from forge_rl.envs.runner import EpisodeLimits, run_episode
from forge_rl.errors import ConfigError
from forge_rl.models.hf_checkpoint import load_hf_state_dict
from forge_rl.models.tiny import TinyModelConfig, create_tiny_model
from forge_rl.tasks.tokenizer import PromptTokenizer, save_char_tokenizer
from forge_rl.training.warmup import demonstration_loss, next_token_batch, warm_up_model
from tests.support.fakes import FakeGenerate
from tests.unit.envs.test_envs import sampled

LIMITS = EpisodeLimits(max_turns=3, max_total_tokens=64, max_tokens_per_turn=12)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> PromptTokenizer:
    model_dir = tmp_path_factory.mktemp("char_tokenizer")
    save_char_tokenizer(model_dir)
    return PromptTokenizer(model_dir)


def test_a_demonstration_is_laid_out_as_the_rl_episode_that_plays_the_same_turns(tokenizer):
    renderer = PlainTextRenderer(tokenizer)
    sample = asyncio.run(demonstration_sample(CalculatorEnv(37, 52), renderer, LIMITS))

    turns = [sampled(tokenizer, "C37*52"), sampled(tokenizer, "1924")]
    rl = asyncio.run(run_episode(CalculatorEnv(37, 52), FakeGenerate(turns), renderer, LIMITS))
    assert sample.token_ids == rl.samples[0].token_ids
    assert sample.loss_mask == rl.samples[0].loss_mask
    assert tokenizer.decode(sample.token_ids) == "37*52=C37*52R1924=1924"
    trained = [t for t, generated in zip(sample.token_ids, sample.loss_mask) if generated]
    # The model's turns and the eos closing each; never the prompt or the tool's result.
    assert trained == tokenizer.encode_text("C37*52") + [tokenizer.eos_id] + tokenizer.encode_text("1924") + [
        tokenizer.eos_id
    ]


@dataclass
class _WrongDemonstration(CalculatorEnv):
    def demonstration(self) -> list[str]:
        return [str(self.left * self.right + 1)]


@dataclass
class _NoDemonstration:
    async def reset(self) -> str:
        return "1*1="


@pytest.mark.parametrize(
    "env, message",
    [
        (_WrongDemonstration(3, 4), "must end DONE with reward 1.0"),
        (_NoDemonstration(), r"has no demonstration\(\) method"),
    ],
)
def test_an_environment_that_cannot_demonstrate_is_refused_by_name(tokenizer, env, message):
    with pytest.raises(ValueError, match=message):
        asyncio.run(demonstration_sample(env, PlainTextRenderer(tokenizer), LIMITS))


def test_the_loss_reads_only_generated_targets_and_never_padding(tokenizer):
    renderer = PlainTextRenderer(tokenizer)
    long = asyncio.run(demonstration_sample(CalculatorEnv(37, 52), renderer, LIMITS))
    short = asyncio.run(demonstration_sample(CalculatorEnv(10, 10), renderer, LIMITS))
    input_ids_NL, target_ids_NL, mask_NL = next_token_batch([long, short], tokenizer.pad_id)
    assert input_ids_NL.shape == target_ids_NL.shape == mask_NL.shape == (2, long.num_tokens - 1)
    assert mask_NL[0].tolist() == long.loss_mask[1:]
    assert mask_NL[1].tolist() == short.loss_mask[1:] + [False] * (long.num_tokens - short.num_tokens)

    vocab = max(tokenizer.encode_text("0123456789CRE*=") + [tokenizer.eos_id, tokenizer.pad_id]) + 1
    # Certain of every generated target and wrong everywhere else: the loss is ~0.
    logits_NLV = torch.full((*target_ids_NL.shape, vocab), -30.0)
    for (row, position), target in zip(mask_NL.nonzero().tolist(), target_ids_NL[mask_NL].tolist()):
        logits_NLV[row, position, target] = 30.0
    assert demonstration_loss(logits_NLV, target_ids_NL, mask_NL).item() < 1e-6
    assert demonstration_loss(torch.zeros_like(logits_NLV), target_ids_NL, mask_NL).item() == pytest.approx(
        torch.log(torch.tensor(float(vocab))).item()
    )


def test_warm_up_trains_the_model_directory_in_place(tmp_path):
    model_dir = create_tiny_model(TinyModelConfig(), tmp_path / "model")
    before = load_hf_state_dict(model_dir)
    environment = EnvironmentConfig(
        name="calculator", limits=LIMITS, warmup=WarmupConfig(episodes=4, steps=3, batch_size=2)
    )
    figures = warm_up_model(model_dir, environment)
    after = load_hf_state_dict(model_dir)
    assert sorted(after) == sorted(before)
    assert any(not torch.equal(before[name], after[name]) for name in before)
    assert figures["warmup/final_loss"] < figures["warmup/first_loss"]
    assert PromptTokenizer(model_dir).eos_id is not None  # still a whole model directory


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # no environment
        {
            "environment": EnvironmentConfig(
                name="calculator", renderer="chat_template", warmup=WarmupConfig(episodes=4)
            )
        },
    ],
)
def test_a_warm_up_without_an_environment_or_the_plain_format_is_refused(overrides):
    fields = {"environment": EnvironmentConfig(warmup=WarmupConfig(episodes=4))} | overrides
    with pytest.raises(ConfigError, match="environment.warmup.episodes"):
        GRPOConfig(**fields)


def test_warmup_config_names_the_bad_field():
    with pytest.raises(ValueError, match="environment.warmup.steps"):
        WarmupConfig(steps=0)


def test_the_no_tool_baseline_demonstrates_a_bare_answer_and_refuses_calls(tokenizer):
    renderer = PlainTextRenderer(tokenizer)
    env = make_calculator_env_without_tool(0, 3)
    assert (env.left, env.right) == (make_calculator_env(0, 3).left, make_calculator_env(0, 3).right)
    sample = asyncio.run(demonstration_sample(env, renderer, LIMITS))
    assert tokenizer.decode(sample.token_ids) == f"{env.left}*{env.right}={env.left * env.right}"
    with pytest.raises(MalformedTurn):
        asyncio.run(make_calculator_env_without_tool(0, 3).step("C1*2"))


def test_task_text_samples_follow_each_problem_with_its_answer_and_eos(tokenizer):
    from forge_rl.tasks import TaskConfig, make_task_prompt
    from forge_rl.training.warmup import task_text_samples

    task = TaskConfig(seed=3)
    [solved] = task_text_samples(tokenizer, task, num_samples=1, problems_per_sample=2)
    [either] = task_text_samples(tokenizer, task, 1, 2, answer=lambda prompt: prompt.text[1])  # its first digit
    first, second = make_task_prompt(task, 0), make_task_prompt(task, 1)
    eos = [tokenizer.eos_id]
    assert solved.token_ids == [tokenizer.bos_id] + tokenizer.encode_text(first.text + first.answer) + eos + (
        tokenizer.encode_text(second.text + second.answer) + eos
    )
    assert either.token_ids == [tokenizer.bos_id] + tokenizer.encode_text(first.text + first.text[1]) + eos + (
        tokenizer.encode_text(second.text + second.text[1]) + eos
    )
    assert solved.loss_mask == [False] + [True] * (len(solved.token_ids) - 1)
