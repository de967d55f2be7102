"""Threads per role chosen from the cores ("auto"): the rule, and a config that asks for it."""

import pytest

from forge_rl.config import GRPOConfig
from forge_rl.engines.config import GeneratorConfig
from forge_rl.errors import ConfigError
from forge_rl.plumbing.placement import LaunchConfig, PlacementConfig
from forge_rl.plumbing.threads import ThreadRoles, choose_threads
from forge_rl.run.preflight import compute_threads
from forge_rl.scoring.judge import JudgeConfig
from forge_rl.scoring.scorers import ScorerConfig
from forge_rl.training.trainer_config import TrainerConfig


def cores(n: int) -> set[int]:
    return set(range(n))


@pytest.mark.parametrize(
    ("num_cores", "trainer_procs", "generators", "fixed", "expected"),
    [
        (2, 1, 1, 0, (1, 1)),  # the laptop demo: one each
        (8, 1, 1, 0, (4, 4)),
        (7, 1, 2, 0, (3, 2)),  # the core left below a share goes to the trainer
        (8, 2, 1, 0, (3, 2)),
        (16, 2, 4, 4, (2, 2)),  # a reward model's 4 threads come off first
        (2, 2, 2, 0, (1, 1)),  # never below one thread, even past the cores
        (4, 0, 1, 0, (0, 4)),  # the trainer set by number (its threads in `fixed`) or simulated
    ],
)
def test_unpinned_roles_share_the_cores_left_by_the_roles_set_by_number(
    num_cores, trainer_procs, generators, fixed, expected
):
    roles = ThreadRoles(trainer_procs=trainer_procs, generators=generators, fixed_threads=fixed)
    assert choose_threads(cores(num_cores), roles) == expected


def test_a_pinned_role_splits_its_own_cores_and_the_others_share_the_rest():
    roles = ThreadRoles(trainer_procs=1, generators=2, fixed_threads=0)
    assert choose_threads(cores(8), roles, generator_cpus=(0, 1, 2, 3)) == (4, 2)
    assert choose_threads(cores(8), roles, trainer_cpus=(6, 7), generator_cpus=(0, 1, 2, 3)) == (2, 2)
    assert choose_threads(cores(8), roles, trainer_cpus=(0, 1, 2, 3, 4, 5, 6)) == (7, 1)


def test_a_config_on_auto_records_the_threads_chosen_for_this_machine(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: cores(8))
    config = GRPOConfig(trainer=TrainerConfig(num_threads="auto"), generator=GeneratorConfig(cpu_threads="auto"))
    assert (config.trainer.num_threads, config.generator.cpu_threads) == (4, 4)
    two_generators = GRPOConfig(
        num_generators=2, trainer=TrainerConfig(num_threads=2), generator=GeneratorConfig(cpu_threads="auto")
    )
    assert (two_generators.trainer.num_threads, two_generators.generator.cpu_threads) == (2, 3)
    assert sum(compute_threads(two_generators).values()) == 8


def test_auto_threads_on_two_cores_are_the_fixed_defaults(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: cores(2))
    auto = GRPOConfig(trainer=TrainerConfig(num_threads="auto"), generator=GeneratorConfig(cpu_threads="auto"))
    assert (
        (auto.trainer.num_threads, auto.generator.cpu_threads)
        == (1, 1)
        == (GRPOConfig().trainer.num_threads, GRPOConfig().generator.cpu_threads)
    )


def test_simulated_roles_run_no_compute_threads_and_take_one(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: cores(4))
    config = GRPOConfig(
        trainer=TrainerConfig(engine="sim", num_threads="auto"),
        generator=GeneratorConfig(engine="sim", cpu_threads="auto"),
    )
    assert (config.trainer.num_threads, config.generator.cpu_threads) == (1, 1)


def test_auto_threads_are_refused_over_worker_hosts_and_for_the_judge(tmp_path):
    launch = LaunchConfig(
        hosts="list",
        workers=("tcp://10.0.0.1:26600", "tcp://10.0.0.2:26600"),
        placement=PlacementConfig(generator_hosts=(1,)),
    )
    with pytest.raises(
        ConfigError, match=r"trainer.num_threads \(auto\) count the cores of this machine, but launch.hosts \(list\)"
    ):
        GRPOConfig(launch=launch, trainer=TrainerConfig(num_threads="auto"))
    (tmp_path / "config.json").write_text("{}")
    judge = JudgeConfig(path=tmp_path, generator=GeneratorConfig(cpu_threads="auto"))
    with pytest.raises(
        ConfigError, match=r"scorer.judge.generator.cpu_threads \(auto\).*Set --scorer.judge.generator.cpu-threads"
    ):
        GRPOConfig(scorer=ScorerConfig(judge=judge))


@pytest.mark.parametrize("value", [0, -1])
def test_a_thread_count_below_one_is_refused_naming_auto(value):
    with pytest.raises(ValueError, match=rf"trainer.num_threads \({value}\) must be >= 1 or auto"):
        TrainerConfig(num_threads=value)
    with pytest.raises(ValueError, match=rf"cpu_threads.*\({value}\).*>= 1 or auto"):
        GeneratorConfig(cpu_threads=value)


def test_the_service_and_the_eval_choose_their_threads_alike(monkeypatch, tmp_path):
    from forge_rl.evaluation.config import EvalConfig
    from forge_rl.run.model_eval import EvalArgs
    from forge_rl.service.config import ServeConfig

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: cores(6))
    serve = ServeConfig(
        trainer=TrainerConfig(num_threads="auto"), generator=GeneratorConfig(cpu_threads="auto"), num_generators=2
    )
    assert (serve.trainer.num_threads, serve.generator.cpu_threads, serve.trainer.lora.enabled) == (2, 2, True)
    evaluation = EvalArgs(
        model_path=tmp_path,
        benchmark="humaneval",
        generator=GeneratorConfig(cpu_threads="auto"),
        eval=EvalConfig(num_generators=3),
    )
    assert evaluation.generator.cpu_threads == 2
