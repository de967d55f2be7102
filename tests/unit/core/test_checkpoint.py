"""Checkpoint layout, picking the newest complete one, pruning, resume config checks, re-issue."""

import dataclasses
import json
import random

import pytest
import torch
import yaml
from hypothesis import given
from hypothesis import strategies as st

from forge_rl.cli import parse_config
from forge_rl.config import GRPOConfig
from forge_rl.core.accounting import PromptAccounting
from forge_rl.core.buffer import BufferConfig, ReplayBuffer
from forge_rl.core.checkpoint import (
    COMPLETE_FILE,
    CONTROLLER_FILE,
    CheckpointConfig,
    ControllerState,
    begin_checkpoint,
    capture_rng_state,
    checkpoints_root,
    commit_checkpoint,
    complete_checkpoints,
    newest_complete_checkpoint,
    prune_checkpoints,
    read_controller_state,
    restore_rng_state,
    resume_hint,
)
from forge_rl.errors import ConfigError, TrainStepTimedOut
from forge_rl.models.titan import ParallelConfig
from forge_rl.run.run_dir import (
    config_to_dict,
    create_run_dir,
    open_run_dir_for_resume,
    remove_unstarted_run_dir,
    saved_config_path,
    truncate_metrics,
)
from forge_rl.tasks.tokenizer import tokenizer_fingerprint
from forge_rl.training.trainer import TrainerConfig
from forge_rl.types import Completion, completion_to_dict
from forge_rl.yaml_config import load_yaml_config
from tests.support.builders import make_episode


def controller_state(step: int, **changes) -> ControllerState:
    fields = dict(
        step=step,
        policy_version=step,
        dataset_cursor=4 * step,
        reissue=[],
        accounting=PromptAccounting().state_dict(),
        buffer=ReplayBuffer(BufferConfig()).state_dict(),
        num_generated_tokens=0,
        rng=capture_rng_state(),
    )
    return ControllerState(**fields | changes)


def save_checkpoint(run_path, step: int, **changes) -> None:
    partial = begin_checkpoint(run_path, step)
    (partial / "trainer").mkdir()
    commit_checkpoint(partial, controller_state(step, **changes))


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("every_n_steps", 0, "checkpoint.every_n_steps (0) must be >= 1. Set --checkpoint.every-n-steps."),
        ("keep_last", 0, "checkpoint.keep_last (0) must be >= 1"),
    ],
)
def test_invalid_checkpoint_config_names_the_field_value_and_flag(field, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        CheckpointConfig(**{field: value})


def test_checkpoint_config_is_read_from_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("checkpoint:\n  enabled: true\n  every_n_steps: 5\n  keep_last: 3\n  save_buffer: true\n")
    checkpoint = load_yaml_config(GRPOConfig, path).checkpoint
    assert (checkpoint.enabled, checkpoint.every_n_steps, checkpoint.keep_last, checkpoint.save_buffer) == (
        True,
        5,
        3,
        True,
    )
    path.write_text("checkpoint:\n  keep_last: 0\n")
    with pytest.raises(ConfigError, match="checkpoint.keep_last"):
        load_yaml_config(GRPOConfig, path)


def test_a_committed_checkpoint_is_complete_and_round_trips(tmp_path):
    partial = begin_checkpoint(tmp_path, 7)
    assert newest_complete_checkpoint(tmp_path) is None  # still being written
    state = controller_state(7, reissue=[3, 5], num_generated_tokens=99)
    path = commit_checkpoint(partial, state)
    assert path == checkpoints_root(tmp_path) / "step-000007" and not partial.exists()
    assert newest_complete_checkpoint(tmp_path) == path
    assert read_controller_state(path) == state
    assert json.loads((path / COMPLETE_FILE).read_text()) == {"step": 7, "policy_version": 7}


def test_the_newest_complete_checkpoint_is_picked_and_half_written_ones_are_ignored(tmp_path):
    for step in (2, 10):
        save_checkpoint(tmp_path, step)
    root = checkpoints_root(tmp_path)
    (root / "step-000012").mkdir()  # final name but no COMPLETE: never trusted
    cut_short = begin_checkpoint(tmp_path, 14)  # killed mid-save: still .partial
    (cut_short / COMPLETE_FILE).write_text("{}")
    (root / "notes").mkdir()
    assert [step for step, _ in complete_checkpoints(tmp_path)] == [2, 10]
    assert newest_complete_checkpoint(tmp_path) == root / "step-000010"
    assert newest_complete_checkpoint(tmp_path / "elsewhere") is None


def test_pruning_keeps_the_newest_complete_ones_and_drops_saves_cut_short(tmp_path):
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step)
    begin_checkpoint(tmp_path, 5)
    deleted = prune_checkpoints(tmp_path, keep_last=2)
    assert sorted(path.name for path in deleted) == [".step-000005.partial", "step-000001", "step-000002"]
    assert sorted(path.name for path in checkpoints_root(tmp_path).iterdir()) == ["step-000003", "step-000004"]
    assert prune_checkpoints(tmp_path, keep_last=2) == []


def test_a_delete_cut_short_is_finished_by_the_next_prune_and_never_looks_like_a_checkpoint(tmp_path):
    # What a controller killed while pruning leaves: the doomed checkpoint already renamed away,
    # part of its files still there.
    for step in (3, 4):
        save_checkpoint(tmp_path, step)
    root = checkpoints_root(tmp_path)
    killed_mid_delete = root / ".step-000002.deleting"
    (killed_mid_delete / "trainer").mkdir(parents=True)
    (killed_mid_delete / "trainer" / "__0_0.distcp").write_bytes(b"shard")
    assert [step for step, _ in complete_checkpoints(tmp_path)] == [3, 4]
    assert prune_checkpoints(tmp_path, keep_last=2) == [killed_mid_delete]
    assert sorted(path.name for path in root.iterdir()) == ["step-000003", "step-000004"]


def test_checkpointing_a_step_again_replaces_its_checkpoint(tmp_path):
    save_checkpoint(tmp_path, 4)
    commit_checkpoint(begin_checkpoint(tmp_path, 4), controller_state(4, num_generated_tokens=5))
    assert read_controller_state(newest_complete_checkpoint(tmp_path)).num_generated_tokens == 5


def test_prompts_not_settled_at_the_checkpoint_are_reissued_in_order():
    # 0-11 handed out: 0-3 and 10 trained, 11 skipped, 5 dropped, 8 in the saved buffer; 4, 6, 7, 9
    # were in flight. The tally ends at 10, the last trained: 11 is settled past it, 12 never handed out.
    accounting = PromptAccounting(handed_out=12)
    accounting.count_trained([make_episode(i) for i in (0, 1, 2, 3, 10)])
    accounting.count_skipped([make_episode(11)])
    assert accounting.unsettled_ids(12, settled_elsewhere=[5, 8]) == [4, 6, 7, 9]
    assert accounting.unsettled_ids(3, settled_elsewhere=[]) == []
    assert accounting.unsettled_ids(14, settled_elsewhere=[]) == [4, 5, 6, 7, 8, 9, 12, 13]


@given(
    trained=st.sets(st.integers(0, 300)),
    skipped=st.sets(st.integers(0, 300)),
    elsewhere=st.sets(st.integers(0, 300)),
    cursor=st.integers(0, 320),
)
def test_unsettled_ids_are_the_definition(trained, skipped, elsewhere, cursor):
    """The C scans of the tally against the definition: every index below the cursor that is in
    no settled set, ascending."""
    accounting = PromptAccounting(handed_out=cursor)
    accounting.count_trained([make_episode(i) for i in sorted(trained)])
    accounting.count_skipped([make_episode(i) for i in sorted(skipped)])
    expected = [i for i in range(cursor) if i not in trained | skipped | elsewhere]
    assert accounting.unsettled_ids(cursor, elsewhere) == expected


def test_accounting_continues_across_a_resume():
    accounting = PromptAccounting(handed_out=6)
    accounting.count_trained([make_episode(0), make_episode(1), make_episode(2)])
    accounting.count_skipped([make_episode(3)])
    reissue = accounting.unsettled_ids(6, settled_elsewhere=[])
    assert reissue == [4, 5]
    resumed = PromptAccounting.from_state_dict(accounting.state_dict(), handed_out=6 - len(reissue))
    resumed.handed_out += 2  # the two re-issued prompts
    resumed.count_trained([make_episode(4), make_episode(5)])
    summary = resumed.summary(num_dropped=0)
    assert summary["trained"] == 5 and summary["skipped_nonfinite"] == 1
    assert summary["unfinished_at_stop"] == 0 and summary["trained_more_than_once"] == 0
    resumed.count_trained([make_episode(0)])
    assert resumed.summary(num_dropped=0)["trained_more_than_once"] == 1


def test_rng_states_round_trip_through_json():
    import numpy as np

    state = json.loads(json.dumps(capture_rng_state()))
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    restore_rng_state(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_the_buffer_checkpoint_holds_episodes_only_when_asked():
    buffer = ReplayBuffer(BufferConfig())
    buffer.put(make_episode(3), trainer_version=0)
    assert buffer.state_dict(include_episodes=False)["episodes"] == []
    restored = ReplayBuffer(BufferConfig())
    restored.load_state_dict(buffer.state_dict())
    assert [e.episode_id for e in restored.sample(1, 0)] == [3]


def test_resume_hint_names_the_command_or_how_to_enable_checkpoints(tmp_path):
    assert "--checkpoint.enabled" in resume_hint(tmp_path, CheckpointConfig())
    assert "no complete checkpoint yet" in resume_hint(tmp_path, CheckpointConfig(enabled=True))
    save_checkpoint(tmp_path, 3)
    hint = resume_hint(tmp_path, CheckpointConfig(enabled=True))
    assert f"forge-rl grpo --resume {tmp_path}" in hint and "step-000003" in hint


def test_a_timed_out_train_steps_message_names_the_step_the_flag_and_the_resume_command(tmp_path):
    """What forge_rl/run/lifecycle.py raises when a train step hangs: the loop's TrainStepTimedOut with
    the run's resume hint."""
    save_checkpoint(tmp_path, 4)
    message = str(TrainStepTimedOut(5, 1800.0, resume_hint(tmp_path, CheckpointConfig(enabled=True))))

    assert message.startswith("train step 5 did not finish within train_step_timeout_s (1800 s)")
    assert "raise --train-step-timeout-s" in message
    assert message.endswith(f"({checkpoints_root(tmp_path) / 'step-000004'}) with: forge-rl grpo --resume {tmp_path}")


@pytest.fixture
def stopped_run(tmp_path):
    """A run directory as a run leaves it: config.yaml (steps 4) and a checkpoint at step 2."""
    config = GRPOConfig(run_dir=tmp_path, run_name="r", steps=4, train_batch_size=8, group_size=4)
    run_path = tmp_path / "r"
    run_path.mkdir()
    saved_config_path(run_path).write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))
    save_checkpoint(run_path, 2)
    return run_path


def test_resume_continues_with_the_saved_config_and_may_change_steps(stopped_run):
    config = parse_config(
        GRPOConfig,
        ["--resume", str(stopped_run), "--steps", "6"],
        prog="forge-rl grpo",
        defaults_file=saved_config_path(stopped_run),
    )
    assert (config.group_size, config.train_batch_size, config.steps) == (4, 8, 6)
    config, run_path, checkpoint = open_run_dir_for_resume(config)
    assert run_path == stopped_run and checkpoint.name == "step-000002"
    assert (config.run_dir, config.run_name) == (stopped_run.parent, "r")
    assert load_yaml_config(GRPOConfig, saved_config_path(stopped_run)).steps == 6  # the next resume's base


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(group_size=2), "group_size (2; the run has 4)"),
        (
            dict(trainer=TrainerConfig(num_procs=2, parallel=ParallelConfig(dp_shard=2))),
            "trainer.num_procs (2; the run has 1)",
        ),
        (dict(steps=2), "is at step 2 and steps is 2, so nothing is left to train. Raise --steps"),
    ],
)
def test_resume_refuses_a_config_that_conflicts_with_the_checkpoint(stopped_run, changes, message):
    saved = load_yaml_config(GRPOConfig, saved_config_path(stopped_run))
    config = GRPOConfig(**{**saved.__dict__, "resume": stopped_run, **changes})
    with pytest.raises(ConfigError) as error:
        open_run_dir_for_resume(config)
    assert message in str(error.value)


def test_resume_refuses_a_data_file_that_changed_since_the_checkpoint(tmp_path, monkeypatch):
    """The checkpoint's cursor counts rows of the file it was taken on: over another file a resume
    would skip or repeat rows, so it is refused before anything starts; the same file resumes."""
    import datasets

    from forge_rl.data.config import DataConfig
    from forge_rl.data.files import FileSource

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"M{i}0=", "answer": str(i)}) + "\n" for i in range(10)))
    data = DataConfig(str(rows), answer_column="answer")
    config = GRPOConfig(run_dir=tmp_path, run_name="r", steps=4, train_batch_size=8, group_size=4, data=data)
    run_path = tmp_path / "r"
    run_path.mkdir()
    saved_config_path(run_path).write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))
    save_checkpoint(run_path, 2, data_fingerprint=FileSource(data).fingerprint)
    resumed = GRPOConfig(**{**config.__dict__, "resume": run_path})
    assert open_run_dir_for_resume(resumed)[2].name == "step-000002"

    rows.write_text(rows.read_text() + json.dumps({"prompt": "M90=", "answer": "9"}) + "\n")
    with pytest.raises(ConfigError, match=r"\(11 rows\) is not the file step-000002 was taken on"):
        open_run_dir_for_resume(resumed)


def test_resume_refuses_a_run_without_a_complete_checkpoint(stopped_run):
    (checkpoints_root(stopped_run) / "step-000002" / COMPLETE_FILE).unlink()
    config = GRPOConfig(resume=stopped_run, steps=6, train_batch_size=8, group_size=4)
    with pytest.raises(ConfigError, match="no complete checkpoint under"):
        open_run_dir_for_resume(config)
    with pytest.raises(ConfigError, match="is not a forge-rl run directory"):
        open_run_dir_for_resume(GRPOConfig(resume=stopped_run / "nope"))


def test_a_run_directory_with_checkpoints_is_kept_and_its_name_points_at_resume(stopped_run):
    assert not remove_unstarted_run_dir(stopped_run)  # no metrics yet, but a checkpoint
    assert stopped_run.is_dir()
    with pytest.raises(ConfigError, match=f"forge-rl grpo --resume {stopped_run}"):
        create_run_dir(GRPOConfig(run_dir=stopped_run.parent, run_name="r"))


def test_a_resume_drops_the_metrics_of_steps_after_its_checkpoint(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": -s}) + "\n" for s in (1, 2, 3)))
    assert truncate_metrics(tmp_path, 2) == [{"step": 1, "loss": -1}, {"step": 2, "loss": -2}]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def partial_group(episode_id: int, token_ids: list[int]) -> dict:
    n = len(token_ids)
    return {
        "episode_id": episode_id,
        "completions": [completion_to_dict(Completion(token_ids, [-0.1] * n, [1] * n))],
        "finished": [False],
    }


@pytest.mark.parametrize(
    "changes,problem",
    [
        (dict(partial_groups=[partial_group(5, [3, 10**6])]), "token id 1000000 is outside the model's vocabulary"),
        (
            dict(partial_groups=[partial_group(5, [3])], tokenizer_fingerprint="0" * 32),
            "sampled under another tokenizer",
        ),
        (dict(partial_groups=[{"episode_id": 5, "completions": "?", "finished": []}]), "partial group 0 is malformed"),
    ],
)
def test_resume_refuses_partial_groups_it_cannot_continue_naming_the_file_or_regenerates_them(
    stopped_run, capsys, changes, problem
):
    """Corrupt, or sampled under another tokenizer: refused before anything starts, naming the
    controller.json, the problem and the fix; with checkpoint.partial_groups_on_error regenerate,
    the resume goes on and says those prompts start afresh."""
    save_checkpoint(stopped_run, 3, reissue=[5], **changes)
    saved = load_yaml_config(GRPOConfig, saved_config_path(stopped_run))
    config = GRPOConfig(**{**saved.__dict__, "resume": stopped_run})
    with pytest.raises(ConfigError) as error:
        open_run_dir_for_resume(config)
    message = str(error.value)
    assert str(checkpoints_root(stopped_run) / "step-000003" / CONTROLLER_FILE) in message
    assert problem in message and "--checkpoint.partial-groups-on-error regenerate" in message

    regenerate = dataclasses.replace(config, checkpoint=CheckpointConfig(partial_groups_on_error="regenerate"))
    assert open_run_dir_for_resume(regenerate)[2].name == "step-000003"
    assert "prompts are generated again from the start" in capsys.readouterr().err


def test_resume_continues_partial_groups_sampled_under_the_same_tokenizer(stopped_run):
    fingerprint = tokenizer_fingerprint(stopped_run / "model")
    save_checkpoint(
        stopped_run, 3, reissue=[5], partial_groups=[partial_group(5, [3, 4])], tokenizer_fingerprint=fingerprint
    )
    saved = load_yaml_config(GRPOConfig, saved_config_path(stopped_run))
    assert open_run_dir_for_resume(GRPOConfig(**{**saved.__dict__, "resume": stopped_run}))[2].name == "step-000003"


def test_resume_starts_the_pool_the_checkpoint_had_unless_num_generators_is_given(stopped_run, capsys):
    """The pool changed size while the run went on (forge-rl scale): a resume starts as many as the
    checkpoint had, not config.yaml's count, unless --num-generators chooses."""
    save_checkpoint(stopped_run, 3, num_generators=2)
    saved = load_yaml_config(GRPOConfig, saved_config_path(stopped_run))
    assert saved.num_generators == 1
    config = GRPOConfig(**{**saved.__dict__, "resume": stopped_run})
    assert open_run_dir_for_resume(config)[0].num_generators == 2
    assert "the pool had 2 generators at step-000003" in capsys.readouterr().err
    assert load_yaml_config(GRPOConfig, saved_config_path(stopped_run)).num_generators == 2
    chosen = dataclasses.replace(config, num_generators=3)
    assert open_run_dir_for_resume(chosen)[0].num_generators == 3
