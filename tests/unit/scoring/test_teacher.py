"""On-policy distillation's core: the teacher scorer's per-token reverse KL, where it lands in the
advantages, and the checks on the teacher's directory and tokenizer (forge_rl/scoring/teacher.py)."""

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from forge_rl.config import GRPOConfig, ModelConfig
from forge_rl.core.batching import make_train_batch
from forge_rl.errors import ConfigError
from forge_rl.models.tiny import TinyModelConfig, create_tiny_model
from forge_rl.run.preflight import check_model_inputs
from forge_rl.scoring.score_writer import ScoreWriter
from forge_rl.scoring.scorers import Score, ScoreFailure, Scorer, ScorerConfig, TeacherScorer, WeightedSum, build_scorer
from forge_rl.scoring.teacher import TeacherConfig, check_same_tokenizer
from forge_rl.tasks.tokenizer import ALPHABET, save_char_tokenizer
from forge_rl.types import Completion, CompletionStatus, Episode

PROMPT = [1, 2, 3]


class FakeOutcome(Scorer):
    """The task's outcome reward, fixed per completion (completion i gets rewards[i])."""

    name = "outcome"

    def __init__(self, rewards):
        self.rewards = rewards

    async def score_group(self, episode):
        return [Score(r) for r in self.rewards]


def fake_teacher(logprobs_by_completion):
    """A fake of the frozen-model actor's `token_logprobs`: fixed teacher logprobs, and the
    episodes it was asked about."""
    asked = []

    async def client(episodes):
        asked.append(episodes)
        return [logprobs_by_completion]

    return client, asked


def scored(episode, scorer, **stage_options):
    asyncio.run(ScoreWriter(scorer, **stage_options).score([episode]))
    return episode


def test_reverse_kl_reaches_exactly_the_sampled_tokens_as_a_negative_advantage():
    """Distillation alone (outcome weight 0), no baseline: every token's advantage is weight *
    (teacher logprob - student logprob) of that token; the prompt, the padding and a multi-turn
    trajectory's context tokens get 0."""
    student = [[-0.5, -2.0, -0.1], [-1.0, -3.0, -0.2, -0.7]]
    teacher = [[-0.1, -4.0, -0.1], [-2.0, -9.9, -0.3, -0.2]]
    completions = [
        Completion(token_ids=[5, 6, 7], logprobs=student[0], policy_versions=[0] * 3),
        # A two-turn trajectory: token 1 is the environment's reply (context, logprob 0 by definition).
        Completion(
            token_ids=[5, 8, 6, 7], logprobs=student[1], policy_versions=[0] * 4, generated=[True, False, True, True]
        ),
    ]
    episode = Episode(0, "M37=", "7", PROMPT, completions)
    client, asked = fake_teacher(teacher)
    weight = 0.5
    scored(episode, WeightedSum([(FakeOutcome([1.0, 0.0]), 0.0), (TeacherScorer(client), weight)]))

    assert asked == [[episode]]  # one request per group
    batch = make_train_batch([episode], pad_id=0)
    prompt = [0.0] * len(PROMPT)
    expected_first = [weight * (t - s) for s, t in zip(student[0], teacher[0])]
    expected_second = [weight * (teacher[1][0] - student[1][0]), 0.0] + [
        weight * (t - s) for s, t in zip(student[1][2:], teacher[1][2:])
    ]
    assert batch.advantages_NL[0].tolist() == pytest.approx(prompt + expected_first + [0.0])  # + padding
    assert batch.advantages_NL[1].tolist() == pytest.approx(prompt + expected_second)
    # A token the teacher finds likelier than the student did is pushed up, an unlikely one down.
    assert batch.advantages_NL[0, len(PROMPT)] > 0 > batch.advantages_NL[0, len(PROMPT) + 1]
    # The distance to the teacher is logged: mean reverse KL over the generated tokens.
    assert completions[0].reward_components["teacher/reverse_kl"] == pytest.approx(
        sum(student[0]) / 3 - sum(teacher[0]) / 3
    )
    assert completions[1].reward_components["teacher/reverse_kl"] == pytest.approx(
        (student[1][0] + student[1][2] + student[1][3] - teacher[1][0] - teacher[1][2] - teacher[1][3]) / 3
    )


def test_each_token_is_centered_on_the_other_samples_at_its_position_never_on_a_mean_holding_itself():
    """Three samples; the third is one token long and the second's token 1 is context. Position 0:
    raw -KL 0.4, -2.0, -0.8, each less the mean of the two others; position 2: the first and second
    sampled there (-1.0 and 0.5), each less the other's."""
    student = [[-1.0, -1.0, -2.0], [-1.0, -1.0, -1.0], [-1.0]]
    teacher = [[-0.6, -3.0, -3.0], [-3.0, -9.0, -0.5], [-1.8]]
    completions = [
        Completion(token_ids=[5, 6, 7], logprobs=student[0], policy_versions=[0] * 3),
        Completion(token_ids=[5, 8, 7], logprobs=student[1], policy_versions=[0] * 3, generated=[True, False, True]),
        Completion(token_ids=[5], logprobs=student[2], policy_versions=[0]),
    ]
    client, _ = fake_teacher(teacher)
    episode = scored(Episode(0, "M37=", "7", PROMPT, completions), TeacherScorer(client), token_baseline="group")
    assert completions[0].token_rewards[0] == pytest.approx(0.4 - (-2.0 - 0.8) / 2)
    assert completions[1].token_rewards[0] == pytest.approx(-2.0 - (0.4 - 0.8) / 2)
    assert completions[2].token_rewards == pytest.approx([-0.8 - (0.4 - 2.0) / 2])
    assert completions[0].token_rewards[2] == pytest.approx(-1.0 - 0.5)
    assert completions[1].token_rewards[1:] == pytest.approx([0.0, 0.5 + 1.0])  # context stays 0
    # The logged distance is the raw reverse KL, not the centered reward.
    assert completions[0].reward_components["reverse_kl"] == pytest.approx((-0.4 + 2.0 + 1.0) / 3)
    batch = make_train_batch([episode], pad_id=0)
    assert batch.advantages_NL[1, len(PROMPT) :].tolist() == pytest.approx([-1.8, 0.0, 1.5])


def test_the_tail_of_the_longest_completion_keeps_the_teachers_signal_under_the_group_baseline():
    """Past the second-longest completion one sample alone reaches a position: there is no other
    sample to compare with, so its token keeps the raw -KL instead of being centered to 0."""
    student = [[-1.0, -1.0, -1.0, -1.0], [-1.0]]
    teacher = [[-0.5, -3.0, -0.2, -4.0], [-2.0]]
    completions = [Completion(token_ids=[5] * len(s), logprobs=s, policy_versions=[0] * len(s)) for s in student]
    client, _ = fake_teacher(teacher)
    scored(Episode(0, "M37=", "7", PROMPT, completions), TeacherScorer(client), token_baseline="group")
    assert completions[0].token_rewards == pytest.approx([0.5 - (-1.0), -2.0, 0.8, -3.0])
    assert completions[1].token_rewards == pytest.approx([-1.0 - 0.5])


def test_the_group_baseline_is_taken_after_combining_scorers_over_usable_completions_only():
    """The outcome scorer fails the third completion (ERRORED, never trained): the teacher's
    reward on it stays out of the others' baseline, and a second dense scorer's rewards are
    centered with the teacher's, as their weighted sum."""

    class FailsLast(Scorer):
        name = "outcome"

        async def score_group(self, episode):
            return [Score(0.0)] * (len(episode.completions) - 1) + [ScoreFailure("verifier raised", "ValueError")]

    class Dense(Scorer):
        name = "dense"

        async def score_group(self, episode):
            return [Score(0.0, token_rewards=(float(i),)) for i, _ in enumerate(episode.completions)]

    student, teacher = [[-1.0], [-1.0], [-1.0]], [[-0.5], [-2.0], [-9.0]]
    completions = [Completion(token_ids=[5], logprobs=s, policy_versions=[0]) for s in student]
    client, _ = fake_teacher(teacher)
    scorer = WeightedSum([(FailsLast(), 1.0), (TeacherScorer(client), 2.0), (Dense(), 1.0)])
    scored(Episode(0, "M37=", "7", PROMPT, completions), scorer, token_baseline="group")
    assert completions[2].status == CompletionStatus.ERRORED
    combined = [2.0 * 0.5 + 0.0, 2.0 * -1.0 + 1.0]  # 2 * (-KL) + the dense scorer's reward
    assert completions[0].token_rewards == pytest.approx([combined[0] - combined[1]])
    assert completions[1].token_rewards == pytest.approx([combined[1] - combined[0]])


def test_with_the_task_reward_the_reverse_kl_adds_to_the_group_advantage():
    student, teacher = [[-1.0, -1.0], [-1.0, -1.0]], [[-0.5, -3.0], [-1.0, -1.0]]
    completions = [Completion(token_ids=[5, 6], logprobs=s, policy_versions=[0, 0]) for s in student]
    episode = Episode(0, "M37=", "7", PROMPT, completions)
    client, _ = fake_teacher(teacher)
    scored(episode, WeightedSum([(FakeOutcome([1.0, 0.0]), 1.0), (TeacherScorer(client), 2.0)]))
    batch = make_train_batch([episode], pad_id=0, normalize_advantage_std=False)
    assert batch.advantages_NL[0, len(PROMPT) :].tolist() == pytest.approx([0.5 + 2 * 0.5, 0.5 + 2 * -2.0])
    assert batch.advantages_NL[1, len(PROMPT) :].tolist() == pytest.approx([-0.5, -0.5])


def test_a_teacher_that_fails_or_answers_the_wrong_shape_errors_its_group_only():
    async def dead_teacher(episodes):
        raise ConnectionError("teacher process died")

    async def short_teacher(episodes):
        return [[[-1.0]] * len(episodes[0].completions)]  # one logprob for two tokens

    for client in (dead_teacher, short_teacher):
        completions = [Completion(token_ids=[5, 6], logprobs=[-1.0, -1.0], policy_versions=[0, 0]) for _ in range(2)]
        episode = scored(Episode(0, "M37=", "7", PROMPT, completions), TeacherScorer(client))
        assert [c.status for c in episode.completions] == [CompletionStatus.ERRORED] * 2


def test_a_teacher_past_its_restart_budget_stops_the_scoring_call_instead_of_erroring_completions():
    """ScorerFailed from the teacher's supervisor (it kept dying) is no completion's fault and no
    failure to score again: it leaves the scoring stage, alone or in a weighted sum, so the run stops."""
    from forge_rl.errors import ScorerFailed

    async def failed_teacher(episodes):
        raise ScorerFailed("the teacher's processes died and scorer.teacher.max_restarts (0) restarts are used up")

    for scorer in (
        TeacherScorer(failed_teacher),
        WeightedSum([(FakeOutcome([1.0, 0.0]), 1.0), (TeacherScorer(failed_teacher), 1.0)]),
    ):
        completions = [Completion(token_ids=[5, 6], logprobs=[-1.0, -1.0], policy_versions=[0, 0]) for _ in range(2)]
        with pytest.raises(ScorerFailed, match="scorer.teacher.max_restarts"):
            scored(Episode(0, "M37=", "7", PROMPT, completions), scorer)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return create_tiny_model(TinyModelConfig(), tmp_path_factory.mktemp("student") / "model")


def teacher_dir(model_dir: Path, tmp_path: Path, alphabet: str = ALPHABET) -> Path:
    teacher = tmp_path / "teacher"
    shutil.copytree(model_dir, teacher)
    save_char_tokenizer(teacher, alphabet)
    return teacher


def test_teacher_and_student_with_the_same_tokenizer_pass(model_dir, tmp_path):
    check_same_tokenizer(teacher_dir(model_dir, tmp_path), model_dir)


def test_a_teacher_with_another_tokenizer_is_a_config_error_before_anything_starts(model_dir, tmp_path):
    # Two characters swapped: same size, same tokens, different ids.
    swapped = "10" + ALPHABET[2:]
    teacher = teacher_dir(model_dir, tmp_path, swapped)
    with pytest.raises(
        ConfigError, match=r"different tokenizer.*2 tokens missing from one or with other ids, e.g. \['0', '1'\]"
    ):
        check_same_tokenizer(teacher, model_dir)
    config = GRPOConfig(
        model=ModelConfig(path=model_dir), scorer=ScorerConfig(teacher=TeacherConfig(path=teacher)), steps=1
    )
    with pytest.raises(ConfigError, match="scorer.teacher.path"):
        check_model_inputs(config, model_dir)  # what create_run_dir runs before any process


def test_a_teacher_directory_that_does_not_exist_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"scorer.teacher.path.*lacks config.json"):
        GRPOConfig(scorer=ScorerConfig(teacher=TeacherConfig(path=tmp_path / "no-such-teacher")))


def test_distillation_alone_needs_no_task_reward_weight():
    ScorerConfig(reward_fn_weight=0.0, teacher=TeacherConfig(path=Path("t")))
    with pytest.raises(ValueError, match="scorer.teacher.weight"):
        TeacherConfig(path=Path("t"), weight=0.0)
    with pytest.raises(ValueError, match="--scorer.teacher.num-procs"):
        TeacherConfig(num_procs=0)


def served_versions(pin: str, rewards=(0.1, 0.5, 0.3, 0.6, 0.2, 0.2, 0.9, 0.1), **changes):
    """(actions, version served) after each of 8 steps; step s publishes version s."""
    from forge_rl.scoring.teacher import TeacherPin

    schedule = TeacherPin(TeacherConfig(pin=pin, **changes))
    return [(schedule.after_step(step, step, r).actions, schedule.serving) for step, r in enumerate(rewards, start=1)]


def test_a_lagged_teacher_serves_the_version_versions_back_right_after_each_refresh():
    # Every 3 steps, 2 back: stage the newest at steps 1, 4, 7; swap at 3, 6 (serving v1, v4).
    assert served_versions("lagged", versions_back=2, refresh_every_n_steps=3) == [
        (("stage",), 0),
        ((), 0),
        (("swap",), 1),
        (("stage",), 1),
        ((), 1),
        (("swap",), 4),
        (("stage",), 4),
        ((), 4),
    ]
    # versions_back == refresh_every_n_steps: the swap of the version staged n steps ago comes first.
    assert [v for _, v in served_versions("lagged", versions_back=3, refresh_every_n_steps=3)] == [
        0,
        0,
        0,
        0,
        0,
        3,
        3,
        3,
    ]


def test_an_ema_teacher_blends_the_newest_version_at_each_refresh():
    from forge_rl.scoring.teacher import TeacherPin

    schedule = TeacherPin(TeacherConfig(pin="ema", refresh_every_n_steps=2, ema_decay=0.75))
    assert schedule.after_step(1, 1, 0.0).actions == ()
    refresh = schedule.after_step(2, 2, 0.0)
    assert (refresh.actions, refresh.version, refresh.blend, schedule.serving) == (("stage", "swap"), 2, 0.75, 2)


def test_a_best_teacher_serves_the_version_after_the_best_step_so_far():
    # Rewards 0.1, 0.5, 0.3, 0.6, 0.2, 0.2, 0.9, 0.1: new bests at steps 1, 2, 4, 7.
    assert served_versions("best", refresh_every_n_steps=2) == [
        (("stage",), 0),
        (("swap", "stage"), 1),
        ((), 1),
        (("swap", "stage"), 2),
        ((), 2),
        (("swap",), 4),
        (("stage",), 4),
        (("swap",), 7),
    ]


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"pin": "lagged", "path": Path("t")}, "a pinned teacher is a snapshot of the policy itself"),
        (
            {"pin": "lagged", "versions_back": 5, "refresh_every_n_steps": 4},
            r"versions_back \(5\) must be in \[1, refresh_every_n_steps \(4\)\]",
        ),
        ({"pin": "ema", "ema_decay": 1.0}, "ema_decay"),
    ],
)
def test_bad_self_distillation_settings_are_refused_with_the_fix(changes, message):
    with pytest.raises(ValueError, match=message):
        TeacherConfig(**changes)


def test_the_recipes_refresh_carries_the_schedule_out_on_the_teacher_actor_in_order():
    """`pinned_teacher_refresh` (the recipe's after_publish) against a fake teacher actor: the
    stage and swap calls of a lagged pin, in order, and the served version as a metric."""
    from forge_rl.observability.timeline import Timeline
    from forge_rl.scoring.teacher import pinned_teacher_refresh
    from tests.support.fakes import endpoints

    calls = []

    async def stage(version, blend):
        calls.append(("stage", version, blend))

    async def swap():
        calls.append(("swap",))

    refresh = pinned_teacher_refresh(
        endpoints(stage=stage, swap=swap), TeacherConfig(pin="lagged", versions_back=1, refresh_every_n_steps=2)
    )
    timeline = Timeline()
    served = [
        asyncio.run(refresh(step, step, {"reward/mean": 0.0}, timeline))["teacher/policy_version"]
        for step in range(1, 5)
    ]
    assert calls == [("stage", 1, None), ("swap",), ("stage", 3, None), ("swap",)]
    assert served == [0, 1, 1, 3]
    # Each stage and swap is on the run's timeline, as the recipe's other calls are.
    assert timeline.busy_s("teacher_stage") > 0 and timeline.busy_s("teacher_swap") > 0


def test_a_pinned_teachers_leases_keep_exactly_its_served_and_staged_versions_in_the_store():
    """`TeacherVersions`: the teacher's supervisor leases each version before staging it and lets
    go of every lease its replacement would not need (the served and the staged versions)."""
    from forge_rl.scoring.teacher import TeacherVersions

    versions = TeacherVersions()
    versions.leased("v00000001")
    assert versions.staged_now(1) == [] and (versions.served, versions.staged) == (0, 1)
    assert versions.swapped() == [] and (versions.served, versions.staged) == (1, None)
    versions.leased("v00000003")
    assert versions.staged_now(3) == []  # v1 is served, v3 staged: both kept
    assert versions.swapped() == ["v00000001"]  # v1 no longer served
    versions.leased("v00000005")
    assert versions.stage_failed() == ["v00000005"]  # the stage of v5 failed: nothing needs it
    versions.leased("v00000003")  # staging the served version again (a second lease on it)
    assert versions.staged_now(3) == ["v00000003"] and versions.swapped() == []
    assert (versions.served, versions.staged) == (3, None)


def test_a_replacement_teacher_reloads_the_served_then_the_staged_version_and_an_ema_says_its_average_restarts():
    from forge_rl.scoring.teacher import TeacherVersions

    versions = TeacherVersions()
    assert versions.reload_plan("lagged") == ([], None)  # the initial policy: its directory has it
    versions.leased("v00000001"), versions.staged_now(1), versions.swapped()
    versions.leased("v00000003"), versions.staged_now(3)
    assert versions.reload_plan("lagged") == ([("stage", 1), ("swap",), ("stage", 3)], None)
    ema = TeacherVersions()
    ema.leased("v00000004"), ema.staged_now(4), ema.swapped()
    calls, note = ema.reload_plan("ema")
    assert calls == [("stage", 4), ("swap",)]
    assert "averaged weights died" in note and "serves policy version 4" in note


@pytest.mark.parametrize(
    "pin,changes", [("lagged", {"versions_back": 2, "refresh_every_n_steps": 3}), ("best", {}), ("ema", {})]
)
def test_a_schedule_restored_from_its_state_goes_on_as_the_uninterrupted_one(pin, changes):
    """What a resume does with a pinned teacher's schedule: saved after step 4 (JSON and back),
    loaded into a fresh schedule, steps 5-8 act and serve as without the stop."""
    from forge_rl.scoring.teacher import TeacherPin

    rewards = (0.1, 0.5, 0.3, 0.6, 0.2, 0.2, 0.9, 0.1)
    uninterrupted = served_versions(pin, rewards, **changes)
    before = TeacherPin(TeacherConfig(pin=pin, **changes))
    for step in range(1, 5):
        before.after_step(step, step, rewards[step - 1])
    resumed = TeacherPin(TeacherConfig(pin=pin, **changes))
    resumed.load_state_dict(json.loads(json.dumps(before.state_dict())))
    after = [(resumed.after_step(s, s, rewards[s - 1]).actions, resumed.serving) for s in range(5, 9)]
    assert after == uninterrupted[4:]


def test_after_a_resume_a_replacement_teacher_loads_the_checkpoints_weights_until_a_refresh_replaces_them():
    from forge_rl.scoring.teacher import TeacherVersions

    ema = TeacherVersions()
    ema.restored("/ckpt/teacher/teacher_weights.pt", served=4, staged=None)
    # The exact average, from the file; nothing to say about an average lost.
    assert ema.reload_plan("ema") == ([("load", "/ckpt/teacher/teacher_weights.pt", True, False)], None)
    lagged = TeacherVersions()
    lagged.restored("/ckpt/teacher/teacher_weights.pt", served=1, staged=3)
    assert lagged.reload_plan("lagged") == ([("load", "/ckpt/teacher/teacher_weights.pt", True, True)], None)
    lagged.swapped()  # serves 3, still from the file
    assert lagged.reload_plan("lagged") == ([("load", "/ckpt/teacher/teacher_weights.pt", True, False)], None)
    lagged.leased("v00000005"), lagged.staged_now(5)  # staged from the store: leased there
    assert lagged.reload_plan("lagged") == (
        [("load", "/ckpt/teacher/teacher_weights.pt", True, False), ("stage", 5)],
        None,
    )
    lagged.swapped()
    assert lagged.reload_plan("lagged") == ([("stage", 5), ("swap",)], None)


def test_an_ema_teacher_that_wrote_its_average_is_reloaded_from_that_file_and_needs_no_lease():
    from forge_rl.scoring.teacher import TeacherVersions

    ema = TeacherVersions()
    ema.leased("v00000002"), ema.staged_now(2), ema.swapped()
    assert ema.served_saved("/run/teacher_ema.pt") == ["v00000002"]  # the file holds the average
    assert ema.reload_plan("ema") == ([("load", "/run/teacher_ema.pt", True, False)], None)
    ema.leased("v00000004"), ema.staged_now(4)
    with pytest.raises(RuntimeError, match="only an ema teacher's, after a swap"):
        ema.served_saved("/run/teacher_ema.pt")
    assert ema.swapped() == [] and ema.served_saved("/run/teacher_ema.pt") == ["v00000004"]


def test_a_pinned_teachers_weights_file_holds_the_served_and_staged_weights_exactly(tmp_path):
    import torch

    from forge_rl.scoring.teacher import load_teacher_weights, save_teacher_weights

    served = {"w": torch.randn(3, 2, generator=torch.Generator().manual_seed(0))}
    staged = {"w": torch.randn(3, 2, generator=torch.Generator().manual_seed(1))}
    save_teacher_weights(tmp_path / "t.pt", served, 4, staged, 5)
    saved = load_teacher_weights(tmp_path / "t.pt")
    assert torch.equal(saved["served"]["w"], served["w"]) and torch.equal(saved["staged"]["w"], staged["w"])
    assert (saved["served_version"], saved["staged_version"]) == (4, 5)
    save_teacher_weights(tmp_path / "t.pt", served, 4, None, None)  # replaced whole
    assert load_teacher_weights(tmp_path / "t.pt")["staged"] is None
    assert [p.name for p in tmp_path.iterdir()] == ["t.pt"]


def test_the_recipes_refresh_checkpoints_the_schedule_and_has_the_teacher_write_and_load_its_weights(tmp_path):
    from forge_rl.observability.timeline import Timeline
    from forge_rl.scoring.teacher import TEACHER_WEIGHTS_FILE, pinned_teacher_refresh
    from tests.support.fakes import endpoints

    calls = []

    async def record(name, *args):
        calls.append((name, *args))

    teacher = endpoints(
        stage=lambda v, b: record("stage", v),
        swap=lambda: record("swap"),
        save_checkpoint=lambda path: record("save", path),
        load_checkpoint=lambda path: record("load", path),
    )
    config = TeacherConfig(pin="lagged", versions_back=1, refresh_every_n_steps=2)
    refresh = pinned_teacher_refresh(teacher, config)
    for step in range(1, 4):
        asyncio.run(refresh(step, step, {"reward/mean": 0.0}, Timeline()))
    asyncio.run(refresh.save_checkpoint(tmp_path / "teacher"))
    weights = str(tmp_path / "teacher" / TEACHER_WEIGHTS_FILE)
    assert calls[-1] == ("save", weights)
    resumed = pinned_teacher_refresh(teacher, config)
    # The fake teacher wrote no file: the resume refuses the checkpoint, naming the file and the fix.
    with pytest.raises(FileNotFoundError, match="no teacher weights"):
        asyncio.run(resumed.load_checkpoint(tmp_path / "teacher"))
    (tmp_path / "teacher" / TEACHER_WEIGHTS_FILE).write_bytes(b"")
    asyncio.run(resumed.load_checkpoint(tmp_path / "teacher"))
    assert calls[-1] == ("load", weights)
    assert resumed.pin.state_dict() == refresh.pin.state_dict() == {"serving": 1, "staged": 3, "best_reward": None}


@pytest.mark.parametrize(
    "config_class,flag",
    [("ReferenceConfig", "--reference.max-restarts"), ("TeacherConfig", "--scorer.teacher.max-restarts")],
)
def test_a_negative_restart_budget_of_a_frozen_model_is_refused_naming_value_and_flag(config_class, flag):
    from forge_rl.scoring import teacher
    from forge_rl.training import reference

    config = getattr(reference, config_class, None) or getattr(teacher, config_class)
    with pytest.raises(ValueError, match=rf"max_restarts \(-1\) must be >= 0. Set {flag}."):
        config(max_restarts=-1)


def test_a_teacher_distills_environment_trajectories_on_top_of_the_environments_rewards():
    """An environment's group (each trajectory holds its prompt as context), scored as a run
    scores it with a teacher: the environment's final and per-turn rewards stay (weighted by
    scorer.reward_fn_weight), the teacher's reverse KL lands on the generated tokens only, centered
    over the usable trajectories, and a trajectory the environment ERRORED stays as it was, out of
    the baseline."""
    mask = [False, False, False, True, True, False, True]  # prompt, turn 1, tool output, turn 2
    completions = [
        Completion(
            token_ids=[1, 7, 11, 40, 41, 16, 42],
            logprobs=[0.0 if not g else -1.0 for g in mask],
            policy_versions=[0] * 7,
            generated=mask,
            reward=1.0,
            step_ends=[5, 7],
            step_rewards=[0.5, 1.0],
        ),
        Completion(
            token_ids=[1, 7, 11, 40, 43, 16, 44],
            logprobs=[0.0 if not g else -1.0 for g in mask],
            policy_versions=[0] * 7,
            generated=mask,
            reward=0.0,
            step_ends=[5, 7],
            step_rewards=[0.0, 0.0],
        ),
        Completion(
            token_ids=[1, 7, 11],
            logprobs=[0.0] * 3,
            policy_versions=[0] * 3,
            generated=[False] * 3,
            status=CompletionStatus.ERRORED,
            error="the environment raised",
        ),
    ]
    episode = Episode(0, "37*52=", "", [], completions)
    client, asked = fake_teacher(
        [[-9.0, -9.0, -9.0, -0.5, -0.5, -9.0, -0.5], [-9.0, -9.0, -9.0, -2.0, -2.0, -9.0, -2.0], [-9.0] * 3]
    )
    config = ScorerConfig(reward_fn_weight=0.5, teacher=TeacherConfig(pin="lagged", versions_back=1))
    stage = ScoreWriter(build_scorer(config, None, teacher=client), token_baseline="group")
    asyncio.run(stage.score([episode]))

    assert asked == [[episode]]
    first, second, errored = completions
    assert (first.reward, first.step_ends, first.step_rewards) == (0.5, [5, 7], [0.25, 0.5])
    assert (second.reward, second.step_rewards) == (0.0, [0.0, 0.0])
    # Raw -KL: +0.5 on the first's generated tokens, -1.0 on the second's; each less the other's.
    assert first.token_rewards == pytest.approx([0.0, 0.0, 0.0, 1.5, 1.5, 0.0, 1.5])
    assert second.token_rewards == pytest.approx([0.0, 0.0, 0.0, -1.5, -1.5, 0.0, -1.5])
    assert first.reward_components["teacher/reverse_kl"] == pytest.approx(-0.5)
    assert (errored.status, errored.error, errored.token_rewards) == (
        CompletionStatus.ERRORED,
        "the environment raised",
        None,
    )
    stats = stage.stats()
    assert stats["scorer/teacher/tokens"] == 6 and stats["scorer/completions"] == 2 and stats["scorer/errored"] == 0


def test_an_environments_episodes_go_through_the_scorer_when_a_teacher_runs():
    from forge_rl.actors.scoring_stage import calls_scorer
    from forge_rl.envs.rollout import EnvironmentConfig
    from forge_rl.envs.runner import EpisodeLimits

    environment = EnvironmentConfig(name="calculator", limits=EpisodeLimits(max_total_tokens=128))
    teacher = ScorerConfig(teacher=TeacherConfig(pin="lagged", versions_back=1))
    assert calls_scorer(GRPOConfig(environment=environment, scorer=teacher))
    assert not calls_scorer(GRPOConfig(environment=environment))  # the environment's reward alone
    assert calls_scorer(GRPOConfig(environment=environment, scorer=ScorerConfig(reward_fn_weight=0.5)))  # weighted
    assert calls_scorer(GRPOConfig())


def test_self_distillation_with_lora_is_refused_at_config_time_naming_the_fields_and_the_fix():
    """With LoRA the weight store holds each version's adapter only, which a pinned teacher cannot
    stage as its weights: refused before anything starts, not at the first refresh."""
    from forge_rl.models.lora_config import LoRAConfig
    from forge_rl.training.trainer_config import TrainerConfig

    lora = TrainerConfig(lora=LoRAConfig(enabled=True))
    with pytest.raises(ConfigError) as error:
        GRPOConfig(trainer=lora, scorer=ScorerConfig(teacher=TeacherConfig(pin="lagged", versions_back=1)))
    message = str(error.value)
    assert "scorer.teacher.pin (lagged)" in message and "trainer.lora.enabled" in message
    assert "--scorer.teacher.path" in message and "--trainer.lora.no-enabled" in message
    GRPOConfig(trainer=lora)  # LoRA alone runs, and so does a fixed teacher with it (it never reads the store)


def test_a_teacher_with_a_shorter_context_than_the_students_sequences_is_refused(tmp_path):
    """The teacher scores whole sequences: prompt and completion (the student's context,
    max_model_len), or with an environment a whole trajectory (environment.limits.max_total_tokens)."""
    from forge_rl.envs.rollout import EnvironmentConfig
    from forge_rl.envs.runner import EpisodeLimits

    short = create_tiny_model(TinyModelConfig(max_position_embeddings=64), tmp_path / "short-teacher")
    teacher = ScorerConfig(teacher=TeacherConfig(path=short))
    with pytest.raises(ConfigError) as error:
        GRPOConfig(scorer=teacher)
    message = str(error.value)
    assert f"scorer.teacher.path ({short}) has a context of 64 tokens" in message
    assert "the student's longest sequence (128 tokens" in message and "max_model_len" in message

    def environment(max_total_tokens):
        return EnvironmentConfig(
            name="calculator", limits=EpisodeLimits(max_total_tokens=max_total_tokens, max_tokens_per_turn=12)
        )

    with pytest.raises(
        ConfigError,
        match=r"longest sequence \(96 tokens: environment.limits.max_total_tokens\).*--environment.limits.max-total-tokens 64",
    ):
        GRPOConfig(scorer=teacher, environment=environment(96))
    GRPOConfig(scorer=teacher, environment=environment(64))  # trajectories that fit the teacher
