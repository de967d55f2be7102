"""Proposer/solver self-play with two policies through a whole run
(configs/selfplay_two_policies_tiny_cpu.yaml): the proposer seat is the run's own policy, the
solver seat a second one with its own trainer, generator, weight store and versions. Each trainer
trains exactly the tokens of the seats its policy plays, each policy's tokens are sampled by its
own generator and held to its own age bound, and every prompt is accounted for."""

from __future__ import annotations

import collections
import json

import pytest

from forge_rl.observability.metric_names import TRAINED_TOKENS
from tests.support.helpers import assert_every_prompt_accounted_for, run_config_file
from tests.support.workers import REPO

pytestmark = pytest.mark.integration

NUM_STEPS = 8


@pytest.fixture(scope="module")
def two_policy_run(tmp_path_factory):
    import dataclasses

    from forge_rl.config import LogConfig

    summary, metrics, config = run_config_file(
        REPO / "configs/selfplay_two_policies_tiny_cpu.yaml",
        tmp_path_factory.mktemp("runs"),
        "two_policies",
        steps=NUM_STEPS,
        log=dataclasses.replace(LogConfig(), rollouts=True),
    )
    run_path = config.run_dir / config.run_name
    rollouts = [json.loads(line) for line in (run_path / "rollouts.jsonl").read_text().splitlines()]
    return summary, metrics, rollouts, config, run_path


def test_each_policy_publishes_versions_of_its_own_every_step(two_policy_run):
    summary, metrics, rollouts, config, run_path = two_policy_run
    assert summary["steps"] == NUM_STEPS
    assert [step["policy_version/main"] for step in metrics] == list(range(1, NUM_STEPS + 1))
    assert [step["policy_version/solver"] for step in metrics] == list(range(1, NUM_STEPS + 1))
    assert all(step["policies/solver/step_skipped"] == 0 for step in metrics)
    processes = json.loads((run_path / "processes.json").read_text())
    assert set(processes["trainer-solver"]).isdisjoint(processes["trainer"])
    assert processes["generators-solver"] != processes["generators"]


def test_each_trainer_trains_exactly_the_tokens_of_the_seats_its_policy_plays(two_policy_run):
    summary, metrics, rollouts, config, run_path = two_policy_run
    trained = collections.defaultdict(collections.Counter)
    for record in rollouts:
        for completion in record["completions"]:
            seat = completion["agent"].split("/", 1)[0]
            assert completion.get("policy") == ("solver" if seat == "solver" else None), completion
            trained[record["step"]][seat] += completion["trained_tokens"]
    assert {step["step"]: int(step[TRAINED_TOKENS]) for step in metrics} == {
        s: c["proposer"] for s, c in trained.items()
    }
    assert {step["step"]: int(step[f"policies/solver/{TRAINED_TOKENS}"]) for step in metrics} == {
        s: c["solver"] for s, c in trained.items()
    }
    assert all(c["solver"] > 0 and c["proposer"] > 0 for c in trained.values())


def test_each_policys_turns_are_sampled_by_its_own_generator(two_policy_run):
    summary, metrics, rollouts, config, run_path = two_policy_run
    components = collections.Counter(
        json.loads(line)["component"] for line in (run_path / "timeline.jsonl").read_text().splitlines()
    )
    # Each turn is one busy interval of the generator that sampled it (the trained episodes' and
    # those in flight at the end).
    solver_turns = sum(1 for r in rollouts for c in r["completions"] if c["agent"].startswith("solver"))
    proposer_turns = sum(1 for r in rollouts for c in r["completions"] if c["agent"] == "proposer")
    assert components["solver/generator0"] >= solver_turns > 0
    assert components["generator0"] >= proposer_turns > 0
    assert components["solver/weights0"] > 0  # the solver's generator loaded the solver's versions


def test_no_token_of_either_policy_older_than_its_own_bound_reaches_its_loss(two_policy_run):
    summary, metrics, rollouts, config, run_path = two_policy_run
    bounds = {"main": config.buffer.max_policy_age, "solver": config.policies[0].max_policy_age}
    for step in metrics:
        for policy, bound in bounds.items():
            assert step[f"policy_age/dependency_max/{policy}"] <= bound, (policy, step["step"])
    assert_every_prompt_accounted_for(summary["accounting"], trained=NUM_STEPS * config.prompts_per_step)


def test_openai_style_agent_code_plays_the_solver_seat_on_the_solvers_policy(tmp_path):
    """environment.name selfplay_chat: each solver is agent code calling an `openai.AsyncOpenAI`
    client (forge_rl/envs/selfplay.py `chat_solver`), served by the solver policy's generator."""
    import dataclasses

    from forge_rl.config import GRPOConfig, LogConfig
    from forge_rl.yaml_config import load_yaml_config

    base = load_yaml_config(GRPOConfig, REPO / "configs/selfplay_two_policies_tiny_cpu.yaml")
    steps = 3
    summary, metrics, config = run_config_file(
        REPO / "configs/selfplay_two_policies_tiny_cpu.yaml",
        tmp_path,
        "chat_solvers",
        steps=steps,
        environment=dataclasses.replace(base.environment, name="selfplay_chat"),
        log=dataclasses.replace(LogConfig(), rollouts=True),
    )
    rollouts = [json.loads(line) for line in (tmp_path / "chat_solvers" / "rollouts.jsonl").read_text().splitlines()]
    solver_tokens = collections.Counter()
    for record in rollouts:
        for completion in record["completions"]:
            if completion["agent"].startswith("solver"):
                assert completion["policy"] == "solver"
                solver_tokens[record["step"]] += completion["trained_tokens"]
    assert {step["step"]: int(step[f"policies/solver/{TRAINED_TOKENS}"]) for step in metrics} == dict(solver_tokens)
    assert all(count > 0 for count in solver_tokens.values())
    assert_every_prompt_accounted_for(summary["accounting"], trained=steps * config.prompts_per_step)


def test_a_checkpoint_holds_every_policys_trainer_and_a_resume_continues_each_ones_versions(tmp_path):
    import dataclasses

    from forge_rl.config import GRPOConfig
    from forge_rl.core.checkpoint import newest_complete_checkpoint, policy_trainer_dir, read_controller_state
    from forge_rl.yaml_config import load_yaml_config

    path = REPO / "configs/selfplay_two_policies_tiny_cpu.yaml"
    checkpoints = dataclasses.replace(load_yaml_config(GRPOConfig, path).checkpoint, enabled=True, every_n_steps=2)
    run_config_file(path, tmp_path, "resumed", steps=2, checkpoint=checkpoints)
    checkpoint = newest_complete_checkpoint(tmp_path / "resumed")
    assert (checkpoint / policy_trainer_dir("solver")).is_dir()
    assert read_controller_state(checkpoint).policy_versions == {"solver": 2}

    summary, metrics, config = run_config_file(
        path, tmp_path, "resumed", steps=4, checkpoint=checkpoints, resume=tmp_path / "resumed"
    )
    assert [step["step"] for step in metrics] == [1, 2, 3, 4]  # the resumed run's metrics follow the first's
    assert [step["policy_version/solver"] for step in metrics[2:]] == [3, 4]
    assert [step["policy_version/main"] for step in metrics[2:]] == [3, 4]
    assert max(step["policy_age/dependency_max/solver"] for step in metrics[2:]) <= config.policies[0].max_policy_age
