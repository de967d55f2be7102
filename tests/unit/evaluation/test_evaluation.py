"""Evaluation at exact policy versions (forge_rl/evaluation/, forge_rl/run/evaluation.py): the config's
checks, the figures of a scored set, the proof of version purity, and the controller's reservations
against the weight store's real index under the train loop's one-step-ahead publishing.

The index is the store's own `VersionIndex`; the store actor and the evaluation's generators are
fakes (FakeIndexActor, FakeEvalGenerators) that answer as the actors do, so the order of commits
and calls is the test's to choose."""

import asyncio
import dataclasses
import json
from pathlib import Path

import datasets
import pytest

from forge_rl.config import GRPOConfig
from forge_rl.data.config import DataConfig
from forge_rl.errors import ConfigError
from forge_rl.evaluation.config import EvalConfig, EvalSetConfig
from forge_rl.evaluation.results import MixedVersions, summarize, version_of
from forge_rl.models.tiny import TinyModelConfig, create_tiny_model
from forge_rl.run import preflight
from forge_rl.run.evaluation import READER_ID, Evaluation, load_eval_set
from forge_rl.store.index import VersionIndex, version_key
from forge_rl.tasks import TaskConfig
from forge_rl.types import Completion, CompletionStatus, Episode


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    # The Arrow cache a file is converted into goes under the test's directory, not the user's home.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def eval_set(path: Path, **fields) -> EvalSetConfig:
    return EvalSetConfig("held_out", DataConfig(str(path), answer_column="answer"), **fields)


def completion(text: str, versions: list[int], reward: float = 0.0, kv_versions=None) -> Completion:
    return Completion(
        token_ids=[5] * len(versions),
        logprobs=[-1.0] * len(versions),
        policy_versions=versions,
        text=text,
        reward=reward,
        kv_versions=kv_versions,
    )


# The config ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            dict(k_values=(1, 4), num_samples=2),
            r"eval.k_values \(\[1, 4\]\) must be one or more k with 1 <= k <= eval.num_samples \(2\)",
        ),
        (dict(num_samples=4, k_values=(1,)), r"eval.temperature 0 \(greedy\) with eval.num_samples 4"),
        (dict(every_n_steps=-1), r"eval.every_n_steps \(-1\) must be >= 0"),
        (dict(max_waiting=0), r"eval.max_waiting \(0\) must be >= 1"),
        (dict(every_n_steps=0, at_start=False, at_end=False), "nothing would be evaluated"),
    ],
)
def test_an_eval_config_that_cannot_work_is_refused_naming_the_field_and_the_fix(tmp_path, fields, message):
    with pytest.raises(ConfigError, match=message):
        EvalConfig(sets=(eval_set(tmp_path / "x.jsonl"),), **fields)


def test_eval_set_names_must_be_unique_and_usable_in_metric_names_and_file_names(tmp_path):
    with pytest.raises(ConfigError, match="must be unique"):
        EvalConfig(sets=(eval_set(tmp_path / "a.jsonl"), eval_set(tmp_path / "b.jsonl")))
    with pytest.raises(ConfigError, match="must be letters, digits"):
        EvalSetConfig("held out/1", DataConfig(str(tmp_path / "a.jsonl")))


def test_the_steps_evaluated_are_every_nth_and_the_last_after_the_start():
    config = EvalConfig(sets=(EvalSetConfig("s", DataConfig("x.jsonl")),), every_n_steps=4)
    assert config.steps(0, 10) == [4, 8, 10]
    assert config.steps(4, 10) == [8, 10]  # resumed after step 4
    assert dataclasses.replace(config, at_end=False).steps(0, 10) == [4, 8]


def test_greedy_sampling_is_refused_for_training_and_allowed_for_evaluation():
    with pytest.raises(ConfigError, match=r"generator.temperature \(0.0\) must be > 0"):
        GRPOConfig(generator=dataclasses.replace(GRPOConfig().generator, temperature=0.0))
    assert Evaluation.generator_config(GRPOConfig()).temperature == 0.0  # eval.temperature's default


# Figures and purity ----------------------------------------------------------------------------


def test_a_sets_figures_are_the_unbiased_pass_at_k_and_errored_samples_fail_and_are_counted():
    episodes = [
        Episode(0, "a", "1", [1], completions=[completion("1", [3], 1.0), completion("2", [3, 3], 0.0)]),
        Episode(1, "b", "2", [1], completions=[completion("x", [3], 0.0), completion("2", [3], 1.0)]),
    ]
    episodes[1].completions[1].status = CompletionStatus.ERRORED  # its reward function raised
    episodes[1].completions[1].error = "ValueError: bad row"
    result = summarize("s", 3, episodes, [10, 11], k_values=(1, 2), pass_threshold=1.0)
    assert result.metrics["eval/s/pass@1"] == pytest.approx((0.5 + 0.0) / 2)
    assert result.metrics["eval/s/pass@2"] == pytest.approx((1.0 + 0.0) / 2)
    assert result.metrics["eval/s/mean_reward"] == pytest.approx(1 / 3)  # the errored sample left out
    assert result.metrics["eval/s/mean_tokens"] == pytest.approx(5 / 4)
    assert (result.metrics["eval/s/num_errored"], result.metrics["eval/s/version"]) == (1, 3)
    assert [p["row"] for p in result.prompts] == [10, 11]
    assert result.prompts[1]["samples"][1] == {
        "text": "2",
        "reward": None,
        "num_tokens": 1,
        "status": "errored",
        "error": "ValueError: bad row",
    }


def test_a_result_is_version_pure_only_when_every_token_and_its_context_came_from_the_version():
    pure = [Episode(0, "a", "1", [1], completions=[completion("1", [4, 4], kv_versions=[4, 4])])]
    assert version_of(pure, 4) == 4
    swapped = [Episode(0, "a", "1", [1], completions=[completion("1", [4, 5])])]
    with pytest.raises(MixedVersions, match=r"an evaluation of policy version 4 sampled tokens with versions \[4, 5\]"):
        version_of(swapped, 4)
    stale_context = [Episode(0, "a", "1", [1], completions=[completion("1", [4, 4], kv_versions=[3, 4])])]
    with pytest.raises(MixedVersions):
        version_of(stale_context, 4)


# The controller's side, against the store's index ---------------------------------------------


class Endpoint:
    def __init__(self, function):
        self.function = function

    async def call_one(self, *args):
        return self.function(*args)


class FakeIndexActor:
    """A fake of StoreIndexActor over the real VersionIndex: what it collects is forgotten at once, as
    the actor deletes it; `wait_for_version` answers when the version is complete (the tests commit
    before they ask)."""

    def __init__(self):
        self.index = VersionIndex(keep_latest=1)
        self.reserve = Endpoint(self.index.reserve)
        self.cancel_reservation = Endpoint(lambda reader, v: self._collect(self.index.cancel_reservation(reader, v)))
        self.latest_version = Endpoint(self.index.latest_version)
        self.wait_for_version = Endpoint(lambda v: self.index.latest_version())

    def publish(self, version: int) -> None:
        self.index.begin(version_key(version), "host:/dev/shm/store")
        self._collect(self.index.commit(version_key(version), 1))

    def _collect(self, keys: list[str]) -> list[str]:
        for key in keys:
            self.index.forget(key)
        return keys


class FakeEvalGenerators:
    """A fake of the evaluation's GeneratorPool: `update_weights(exact)` leases the version as the
    real loader does (refused if it was collected); `generate` answers every prompt with its answer,
    sampled by the loaded version."""

    def __init__(self, store: FakeIndexActor):
        self.store = store
        self.loaded = 0
        self.update_weights = Endpoint(self._update_weights)
        self.generate = Endpoint(self._generate)

    def _update_weights(self, index, version, exact):
        assert exact
        if version != self.loaded:
            self.store.index.acquire("eval_generator", version_key(version))  # raises if collected
            self.store.index.release("eval_generator", version_key(version))
            self.loaded = version
        return {"policy_version": version}

    def _generate(self, index, episodes, num_samples):
        for episode in episodes:
            episode.completions = [completion(episode.answer, [self.loaded]) for _ in range(num_samples)]
        return episodes


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return create_tiny_model(TinyModelConfig(), tmp_path_factory.mktemp("tiny") / "model")


def run_config(tmp_path: Path, tiny_model: Path, **eval_fields) -> GRPOConfig:
    rows = tmp_path / "held_out.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"M{i}{i}=", "answer": str(i)}) + "\n" for i in range(10)))
    return GRPOConfig(
        steps=6,
        run_dir=tmp_path,
        task=TaskConfig(reward="exact_match"),
        model=dataclasses.replace(GRPOConfig().model, path=tiny_model),
        eval=EvalConfig(sets=(eval_set(rows, max_prompts=6),), **eval_fields),
    )


class FakeMetricsLogger:
    def __init__(self):
        self.logged = []

    def log_to_sinks(self, record):
        self.logged.append(record)


async def train_one_step_ahead(evaluation: Evaluation, store: FakeIndexActor, steps: int, skipped=()) -> None:
    """What the train loop does to the store and the evaluation: step s's version commits, and so
    does step s+1's (sent ahead, it trains while step s is accounted for) before `published(s)`."""
    version = 0
    versions = {}
    for step in range(1, steps + 2):
        if step not in skipped:
            version += 1
        versions[step] = version
    committed = set()
    for step in range(1, steps + 1):
        for ahead in (step, step + 1):  # the step and the one sent ahead of it
            if ahead <= steps and ahead not in skipped and versions[ahead] not in committed:
                store.publish(versions[ahead])
                committed.add(versions[ahead])
        await evaluation.published(step, versions[step])


def test_every_due_version_is_evaluated_exactly_though_the_next_one_commits_before_the_controller_hears_of_it(
    tmp_path, tiny_model
):
    """With keep_latest 1 and no reservation, version s is collected when version s+1 commits,
    which happens before `published(s)` (one step ahead): only the reservation made at step s-1
    lets the evaluation load exactly s (the fake generators lease it and fail if it is gone)."""
    store = FakeIndexActor()
    config = run_config(tmp_path, tiny_model, every_n_steps=2, max_waiting=10)
    evaluation = Evaluation(config, FakeEvalGenerators(store), store, tmp_path, tiny_model)
    logger = FakeMetricsLogger()

    async def run():
        await evaluation.start(0, 0, logger)
        await train_one_step_ahead(evaluation, store, config.steps)
        return await evaluation.finish()

    results = asyncio.run(run())
    records = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [(r["step"], r["policy_version"]) for r in records] == [(0, 0), (2, 2), (4, 4), (6, 6)]
    assert all(r["eval/held_out/pass@1"] == 1.0 and r["eval/failed"] == 0 for r in records)
    assert logger.logged == records
    assert results["held_out"]["eval/held_out/version"] == 6
    assert all(store.index.holders(key) == {} for key in store.index.keys())  # every reservation released
    per_prompt = [
        json.loads(line) for line in (tmp_path / "eval" / "held_out" / "version-4.jsonl").read_text().splitlines()
    ]
    assert len(per_prompt) == 6 and all(p["samples"][0]["reward"] == 1.0 for p in per_prompt)


def test_a_skipped_step_before_a_due_one_releases_its_reservation_and_the_due_step_is_still_exact(tmp_path, tiny_model):
    """Step 3 is skipped (no version), so the version reserved at step 3 for step 4 is made by step 4
    itself (3, not 4): the evaluation takes it, and the reservation that no step made is withdrawn."""
    store = FakeIndexActor()
    config = run_config(tmp_path, tiny_model, every_n_steps=2, max_waiting=10, at_start=False)
    evaluation = Evaluation(config, FakeEvalGenerators(store), store, tmp_path, tiny_model)

    async def run():
        await evaluation.start(0, 0, FakeMetricsLogger())
        await train_one_step_ahead(evaluation, store, config.steps, skipped={3})
        await evaluation.finish()

    asyncio.run(run())
    records = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [(r["step"], r["policy_version"]) for r in records] == [(2, 2), (4, 3), (6, 5)]
    assert all(r["eval/failed"] == 0 for r in records)
    assert evaluation.reserved == set()
    assert all(store.index.holders(key) == {} for key in store.index.keys())


def test_an_evaluation_slower_than_training_falls_behind_in_versions_and_holds_no_more_than_it_may(
    tmp_path, tiny_model
):
    """The first evaluation is held in its generate call; meanwhile every step is due:
    with eval.max_waiting 1 each newer version's evaluation drops the one waiting (counted), so the
    store holds at most the running one's version and one waiting."""
    store = FakeIndexActor()
    generators = FakeEvalGenerators(store)
    release, sampling = asyncio.Event(), asyncio.Event()
    config = run_config(tmp_path, tiny_model, every_n_steps=1, max_waiting=1)
    evaluation = Evaluation(config, generators, store, tmp_path, tiny_model)
    answer = generators.generate.function

    async def held_generate(index, episodes, num_samples):
        sampling.set()
        await release.wait()
        return answer(index, episodes, num_samples)

    generators.generate = type("HeldEndpoint", (), {"call_one": staticmethod(held_generate)})()

    async def run():
        await evaluation.start(0, 0, FakeMetricsLogger())
        await sampling.wait()  # version 0's evaluation runs, held
        await train_one_step_ahead(evaluation, store, config.steps)
        held = [key for key in store.index.keys() if store.index.holders(key).get(READER_ID)]
        release.set()
        await evaluation.finish()
        return held

    held = asyncio.run(run())
    assert held == [version_key(6)]  # version 0 (running, never in the store) and 6 (waiting)
    records = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in records] == [0, 6]
    assert records[-1]["eval/dropped"] == 5


# Bad input, before anything starts ------------------------------------------------------------


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_missing_eval_file_is_refused_before_the_run_starts_naming_the_set(tmp_path, tiny_model):
    config = dataclasses.replace(
        run_config(tmp_path, tiny_model), eval=EvalConfig(sets=(eval_set(tmp_path / "missing.jsonl"),))
    )
    with pytest.raises(ConfigError, match=r"eval.sets\[0\].data.path \('.*missing.jsonl'\): no file or directory"):
        preflight.check_model_inputs(config, tiny_model)


def test_an_eval_set_without_the_answers_its_reward_compares_with_is_refused_naming_the_flag(tmp_path, tiny_model):
    rows = write_rows(tmp_path / "no_answers.jsonl", [{"prompt": "M12=", "solution": "2"}])
    config = dataclasses.replace(
        run_config(tmp_path, tiny_model), eval=EvalConfig(sets=(EvalSetConfig("held_out", DataConfig(str(rows))),))
    )
    with pytest.raises(
        ConfigError, match=r"eval.sets\[0\].data.answer_column is unset. Set --eval.sets.0.data.answer-column"
    ):
        preflight.check_model_inputs(config, tiny_model)


def test_an_eval_set_sharing_prompts_with_the_training_data_is_warned_about_with_the_count(
    tmp_path, tiny_model, capsys
):
    train = write_rows(tmp_path / "train.jsonl", [{"prompt": f"M{i}0=", "answer": str(i)} for i in range(8)])
    held = write_rows(tmp_path / "held.jsonl", [{"prompt": f"M{i}0=", "answer": str(i)} for i in range(6, 12)])
    config = dataclasses.replace(
        run_config(tmp_path, tiny_model),
        data=DataConfig(str(train), answer_column="answer"),
        eval=EvalConfig(sets=(eval_set(held, max_prompts=6),)),
    )
    preflight.check_model_inputs(config, tiny_model)
    assert "eval set 'held_out' shares 2 of its 6 evaluated prompts with the training data" in capsys.readouterr().err


def test_an_eval_set_larger_than_max_prompts_is_cut_to_a_fixed_sample_with_a_warning(tmp_path, tiny_model, capsys):
    config = run_config(tmp_path, tiny_model)  # its set: 10 rows, max_prompts 6
    evaluation = Evaluation(config, None, None, tmp_path, tiny_model)

    def load():
        return load_eval_set(
            config.eval.sets[0], config, evaluation.tokenizer, evaluation.max_new_tokens, "eval.sets[0].data"
        )

    first, again = load(), load()
    assert len(first) == 6 and [p.row_number for p in first] == [p.row_number for p in again]
    assert "10 rows, of which the first 6" in capsys.readouterr().err


def test_the_docs_complete_example_builds_its_files_and_a_config_preflight_accepts(tmp_path, monkeypatch, capsys):
    """docs/evaluation.md's example as written: its two export commands, then its YAML with the flags
    it names, through the CLI's parser and the checks a run makes before it starts."""
    import re
    import shlex

    from forge_rl import cli
    from forge_rl.models.tiny import TinyModelConfig

    doc = (Path(__file__).parents[3] / "docs" / "evaluation.md").read_text()
    commands = [
        line for line in re.findall(r"```bash\n(.*?)```", doc, re.S)[0].splitlines() if line.startswith("forge-rl data")
    ]
    monkeypatch.chdir(tmp_path)
    for command in commands:
        cli.run(shlex.split(command)[1:])
    (tmp_path / "held_out_demo.yaml").write_text(re.findall(r"```yaml\n(.*?)```", doc, re.S)[0])
    config = cli.parse_config(
        GRPOConfig,
        ["--config", "held_out_demo.yaml", "--eval.every-n-steps", "25", "--eval.sets.0.max-prompts", "10"],
        prog="forge-rl grpo",
    )
    assert (config.eval.every_n_steps, config.eval.sets[0].max_prompts) == (25, 10)
    model_dir = create_tiny_model(TinyModelConfig(**dataclasses.asdict(config.model.tiny)), tmp_path / "model")
    preflight.check_model_inputs(config, model_dir)
    assert "shares" not in capsys.readouterr().err  # the two files are disjoint


class FakeRunGenerators:
    """A fake of the run's GeneratorPool for eval.placement shared: generator i serves
    `serving[i]`; `generate_pinned` samples with it when it is the version asked for, else None
    (the real generator waits for an older one to be served, and answers None for one it passed)."""

    def __init__(self, num_generators: int):
        self.serving = [0] * num_generators
        self.calls = []
        self.generate_pinned = Endpoint(self._generate_pinned)

    def _generate_pinned(self, index, version, episodes, num_samples, temperature, max_new_tokens, max_in_flight):
        self.calls.append((index, version, len(episodes), temperature, max_new_tokens, max_in_flight))
        if self.serving[index] != version:
            return None
        for episode in episodes:
            episode.completions = [completion(episode.answer, [version]) for _ in range(num_samples)]
        return episodes


def test_a_shared_evaluation_splits_its_prompts_over_the_runs_generators_pinned_to_the_version(tmp_path, tiny_model):
    config = dataclasses.replace(
        run_config(
            tmp_path, tiny_model, every_n_steps=3, at_start=False, placement="shared", shared_prompts_in_flight=2
        ),
        num_generators=2,
    )
    generators = FakeRunGenerators(2)
    evaluation = Evaluation(config, generators, None, tmp_path, tiny_model)
    logger = FakeMetricsLogger()

    async def run():
        evaluated = asyncio.Event()
        logger.log_to_sinks = lambda record: (logger.logged.append(record), evaluated.set())
        await evaluation.start(0, 0, logger)
        for step in range(1, config.steps + 1):
            generators.serving = [step, step] if step != 6 else [6, 7]  # generator 1 moved on before step 6's eval
            await evaluation.published(step, step)
            if step == 3:
                await evaluated.wait()  # step 3's evaluation, while its generators serve 3
        return await evaluation.finish()

    asyncio.run(run())
    records = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [(r["step"], r["policy_version"], r["eval/held_out/pass@1"]) for r in records] == [(3, 3, 1.0)]
    assert evaluation.num_failed == 1  # step 6: generator 1 served 7 when the call came
    assert {(index, n) for index, _, n, *_ in generators.calls} == {(0, 3), (1, 3)}  # 6 prompts, split over 2
    assert all(call[3:] == (0.0, config.generator.max_new_tokens, 2) for call in generators.calls)
