"""Multi-host launching without Monarch: SLURM nodelists, worker addresses, placement and host checks."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import time

import pytest

from forge_rl.errors import ConfigError
from forge_rl.plumbing.cpu_affinity import pin_this_process
from forge_rl.plumbing.placement import (
    HostFacts,
    LaunchConfig,
    PlacementConfig,
    RoleDemand,
    check_gpus,
    check_host_facts,
    check_pinned_cores,
    check_placement,
    generator_devices,
)
from forge_rl.plumbing.workers import (
    check_reachable,
    expand_nodelist,
    hostnames_resolve_apart,
    parse_worker_address,
    slurm_worker_addresses,
)


@pytest.mark.parametrize(
    "nodelist,expected",
    [
        ("node1", ["node1"]),
        ("node[1-3]", ["node1", "node2", "node3"]),
        ("gpu[01-03,07],cpu-a1", ["gpu01", "gpu02", "gpu03", "gpu07", "cpu-a1"]),
        ("a[8-10]", ["a8", "a9", "a10"]),
        ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),
        ("rack[1-2]-ib", ["rack1-ib", "rack2-ib"]),
        ("x[001-002],y[9]", ["x001", "x002", "y9"]),
    ],
)
def test_slurm_nodelists_expand_like_scontrol_show_hostnames(nodelist, expected):
    assert expand_nodelist(nodelist) == expected


@pytest.mark.parametrize("nodelist", ["node[1-3", "node[3-1]", "node[a-b]", "a,,b"])
def test_malformed_nodelists_are_refused(nodelist):
    with pytest.raises(ConfigError, match="SLURM nodelist"):
        expand_nodelist(nodelist)


def test_slurm_workers_come_from_the_allocation():
    environ = {"SLURM_JOB_NODELIST": "gpu[1-2]"}
    assert slurm_worker_addresses(26600, environ) == ["tcp://gpu1:26600", "tcp://gpu2:26600"]
    with pytest.raises(ConfigError, match="not a SLURM allocation.*sbatch"):
        slurm_worker_addresses(26600, {})


@pytest.mark.parametrize(
    "address,expected",
    [
        ("tcp://node1:26600", ("node1", 26600)),
        ("tcp://10.0.0.5:1", ("10.0.0.5", 1)),
        ("tcp://[::1]:26600", ("::1", 26600)),
    ],
)
def test_worker_addresses_parse(address, expected):
    assert parse_worker_address(address) == expected


@pytest.mark.parametrize(
    "address", ["node1:26600", "tcp://node1", "tcp://node1:0", "tcp://node1:70000", "ipc://x", "tcp://a b:1"]
)
def test_malformed_worker_addresses_name_the_entry_and_the_form(address):
    with pytest.raises(ConfigError) as error:
        parse_worker_address(address)
    assert repr(address) in str(error.value) and "tcp://HOST:PORT" in str(error.value)


def _list(num_hosts: int, **placement) -> LaunchConfig:
    return LaunchConfig(
        hosts="list",
        workers=tuple(f"tcp://h{i}:26600" for i in range(num_hosts)),
        placement=PlacementConfig(**placement),
    )


def test_placement_rules_that_need_no_host():
    demand = RoleDemand(trainer_procs=4, reference_procs=0, num_generators=2)
    check_placement(_list(3, trainer_hosts=(0, 1), generator_hosts=(2,)), demand)  # 2 ranks per host
    with pytest.raises(ConfigError, match=r"trainer.num_procs \(4\) is not divisible by the 3 host"):
        check_placement(_list(4, trainer_hosts=(0, 1, 2), generator_hosts=(3,)), demand)
    with pytest.raises(ConfigError, match="host 1 runs trainer/reference ranks and generators.*allow-shared-hosts"):
        check_placement(_list(2, trainer_hosts=(0, 1), generator_hosts=(1,)), demand)
    allowed = LaunchConfig(
        hosts="list",
        workers=("tcp://h0:1", "tcp://h1:1"),
        allow_shared_hosts=True,
        placement=PlacementConfig(trainer_hosts=(0, 1), generator_hosts=(1,)),
    )
    check_placement(allowed, demand)
    check_placement(LaunchConfig(), demand)  # one machine shares by definition (preflight checks it)


def test_generators_cycle_over_their_hosts():
    placement = PlacementConfig(generator_hosts=(1, 2))
    assert [placement.generator_host(i) for i in range(5)] == [1, 2, 1, 2, 1]


def _facts(hostname: str, gpus: int = 0, cpus: int = 8, rdma: str = "ibverbs", visible: bool = True) -> HostFacts:
    return HostFacts(f"tcp://{hostname}:26600", hostname, gpus, tuple(range(cpus)), rdma, visible)


def test_host_facts_allow_a_placement_that_fits():
    launch = _list(2, trainer_hosts=(0,), generator_hosts=(1,))
    demand = RoleDemand(trainer_procs=8, reference_procs=0, num_generators=8)
    notes = check_host_facts(launch, demand, [_facts("a", gpus=8), _facts("b", gpus=8)], "/shared/run/model")
    assert notes == []


def test_host_facts_refuse_more_gpu_processes_than_gpus():
    launch = _list(2, trainer_hosts=(0,), generator_hosts=(1,))
    demand = RoleDemand(trainer_procs=8, reference_procs=0, num_generators=9)
    with pytest.raises(
        ConfigError,
        match=r"host 1 \(b, tcp://b:26600\) has 8 GPU\(s\) but the placement needs 9 there: "
        r"9 generator\(s\) x 1 GPU\(s\).*--launch.placement.*--num-generators",
    ):
        check_host_facts(launch, demand, [_facts("a", gpus=8), _facts("b", gpus=8)], "/m")


def _demand(
    trainer_procs: int = 0, num_generators: int = 1, generator_gpus: int = 1, reference_procs: int = 0
) -> RoleDemand:
    return RoleDemand(
        trainer_procs=trainer_procs,
        reference_procs=reference_procs,
        num_generators=num_generators,
        generator_gpus=generator_gpus,
    )


def test_generators_on_one_host_take_one_device_each_after_the_trainer_ranks():
    assert generator_devices(LaunchConfig(), _demand(trainer_procs=2, num_generators=3)) == [(2,), (3,), (4,)]
    assert generator_devices(LaunchConfig(), _demand(trainer_procs=1, num_generators=1)) == [(1,)]


def test_a_generator_device_is_its_index_among_its_hosts_generators():
    launch = _list(3, trainer_hosts=(0,), generator_hosts=(1, 2))
    assert generator_devices(launch, _demand(trainer_procs=8, num_generators=5)) == [(0,), (0,), (1,), (1,), (2,)]


def test_generators_on_a_host_shared_with_trainer_ranks_start_after_the_ranks_devices():
    launch = LaunchConfig(
        hosts="list",
        workers=("tcp://h0:1", "tcp://h1:1"),
        allow_shared_hosts=True,
        placement=PlacementConfig(trainer_hosts=(0, 1), generator_hosts=(1, 0, 1)),
    )
    # 4 ranks per host on devices 0..3; host 1 holds generators 0 and 2, host 0 generator 1.
    assert generator_devices(launch, _demand(trainer_procs=8, num_generators=3)) == [(4,), (4,), (5,)]
    # Reference ranks number their local ranks from 0 too: they share the trainer ranks' devices.
    with_reference = _demand(trainer_procs=8, reference_procs=12, num_generators=3)
    assert generator_devices(launch, with_reference) == [(6,), (6,), (7,)]


def test_tensor_parallel_generators_take_contiguous_blocks():
    assert generator_devices(LaunchConfig(), _demand(trainer_procs=2, num_generators=3, generator_gpus=2)) == [
        (2, 3),
        (4, 5),
        (6, 7),
    ]
    launch = _list(2, trainer_hosts=(0,), generator_hosts=(1,))
    assert generator_devices(launch, _demand(trainer_procs=4, num_generators=2, generator_gpus=4)) == [
        (0, 1, 2, 3),
        (4, 5, 6, 7),
    ]


def test_share_gpus_puts_generators_on_the_ranks_devices():
    share = LaunchConfig(share_gpus=True)
    assert generator_devices(share, _demand(trainer_procs=1, num_generators=1)) == [(0,)]
    assert generator_devices(share, _demand(trainer_procs=4, num_generators=2, generator_gpus=2)) == [(0, 1), (2, 3)]
    check_gpus(share, _demand(trainer_procs=1, num_generators=1), 0, 1, "this machine")  # the whole loop on one GPU


def test_gpu_check_names_the_host_the_roles_the_counts_and_the_flags():
    check_gpus(LaunchConfig(), _demand(trainer_procs=2, num_generators=3, generator_gpus=2), 0, 8, "this machine")
    with pytest.raises(
        ConfigError,
        match=r"this machine has 1 GPU\(s\) but the placement needs 2 there: 1 trainer "
        r"rank\(s\) on devices 0..0 \+ 1 generator\(s\) x 1 GPU\(s\) .* from device 1.*"
        r"--launch.share-gpus true",
    ):
        check_gpus(LaunchConfig(), _demand(trainer_procs=1, num_generators=1), 0, 1, "this machine")
    with pytest.raises(
        ConfigError,
        match=r"has 8 GPU\(s\) but the placement needs 10 there.*"
        r"5 generator\(s\) x 2 GPU\(s\) \(generator.tensor_parallel_size\).*--generator.tensor-parallel-size",
    ):
        check_gpus(
            _list(2, trainer_hosts=(0,), generator_hosts=(1,)),
            _demand(trainer_procs=8, num_generators=5, generator_gpus=2),
            1,
            8,
            "host 1",
        )
    with pytest.raises(
        ConfigError,
        match=r"needs 5 there: 4 trainer rank\(s\) on devices 0..3 \+ 2 reference "
        r"rank\(s\) on devices 0..1 \+ 1 generator\(s\) x 1 GPU\(s\) .* from device 4",
    ):
        check_gpus(LaunchConfig(), _demand(trainer_procs=4, reference_procs=2, num_generators=1), 0, 4, "this machine")


def test_tensor_parallel_generators_are_refused_on_a_host_without_gpus():
    launch = _list(2, trainer_hosts=(0,), generator_hosts=(1,))
    with pytest.raises(
        ConfigError,
        match=r"host 1 \(b.*has no GPU, but generator.tensor_parallel_size \(2\) > 1.*"
        r"vLLM's CPU backend with one worker.*--generator.tensor-parallel-size 1",
    ):
        check_host_facts(
            launch, _demand(trainer_procs=1, num_generators=1, generator_gpus=2), [_facts("a"), _facts("b")], "/m"
        )
    check_gpus(
        launch, _demand(trainer_procs=1, num_generators=1, generator_gpus=2), 0, 0, "host 0"
    )  # no generator there


def test_host_facts_refuse_oversubscribed_cpu_hosts():
    launch = _list(2, trainer_hosts=(0,), generator_hosts=(1,))
    demand = RoleDemand(trainer_procs=2, reference_procs=0, num_generators=9, generator_threads=1)
    with pytest.raises(ConfigError, match=r"host 1 \(b.*no GPU and 2 core\(s\).*9 compute threads"):
        check_host_facts(launch, demand, [_facts("a", cpus=2), _facts("b", cpus=2)], "/m")


@pytest.mark.parametrize("cores", [(), (-1,), (0, 0)])
def test_pinned_cores_must_be_distinct_ids(cores):
    with pytest.raises(
        ConfigError, match=r"launch.placement.trainer_cpus .* distinct core ids >= 0.*--launch.placement.trainer-cpus 0"
    ):
        PlacementConfig(trainer_cpus=cores)


def test_pinned_cores_must_exist_where_the_role_runs():
    check_pinned_cores(PlacementConfig(generator_cpus=(0,), trainer_cpus=(1,)), {0, 1}, "this machine")
    with pytest.raises(
        ConfigError,
        match=r"generator_cpus \(\[0, 4\]\) names core 4, but this machine lets processes run on cores \[0, 1\] only.*--launch.placement.generator-cpus",
    ):
        check_pinned_cores(PlacementConfig(generator_cpus=(0, 4)), {0, 1}, "this machine")
    launch = _list(2, trainer_hosts=(0,), generator_hosts=(1,))
    launch = dataclasses.replace(launch, placement=dataclasses.replace(launch.placement, trainer_cpus=(3,)))
    demand = RoleDemand(trainer_procs=1, reference_procs=0, num_generators=1)
    with pytest.raises(ConfigError, match=r"trainer_cpus \(\[3\]\) names core 3, but host 0 \(a"):
        check_host_facts(launch, demand, [_facts("a", cpus=2), _facts("b", cpus=8)], "/m")


PIN_A_THREAD_STARTED_BEFORE = """
import os, threading
from forge_rl.plumbing.cpu_affinity import pin_this_process
ready, done = threading.Event(), threading.Event()
def runtime_thread():  # like a runtime's thread, running before the pin
    ready.set(); done.wait()
    print(sorted(os.sched_getaffinity(0)))
thread = threading.Thread(target=runtime_thread); thread.start(); ready.wait()
print(pin_this_process(({core},)))
done.set(); thread.join()
"""


def test_pinning_a_process_pins_its_threads_already_running():
    core = max(os.sched_getaffinity(0))
    script = PIN_A_THREAD_STARTED_BEFORE.format(core=core)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:2] == [f"[{core}]", f"[{core}]"]
    assert pin_this_process(None) == sorted(os.sched_getaffinity(0))  # None: left as it is


def test_host_facts_need_the_run_directory_on_every_host():
    launch = _list(2, trainer_hosts=(0,), generator_hosts=(1,))
    demand = RoleDemand(trainer_procs=1, reference_procs=0, num_generators=1)
    with pytest.raises(ConfigError, match="host 1 .* cannot see the run's model directory /tmp/r/model.*shared"):
        check_host_facts(launch, demand, [_facts("a"), _facts("b", visible=False)], "/tmp/r/model")


def test_cross_host_weights_need_an_rdma_backend_and_tcp_fallback_is_noted():
    launch = _list(2, trainer_hosts=(0,), generator_hosts=(1,))
    demand = RoleDemand(trainer_procs=1, reference_procs=0, num_generators=1)
    with pytest.raises(ConfigError, match="no RDMA backend on the generator's host b.*rdma-core"):
        check_host_facts(launch, demand, [_facts("a"), _facts("b", rdma="none")], "/m")
    notes = check_host_facts(launch, demand, [_facts("a"), _facts("b", rdma="tcp")], "/m")
    assert len(notes) == 1 and "TCP fallback" in notes[0]
    same_host = check_host_facts(launch, demand, [_facts("a", rdma="none"), _facts("a", rdma="none")], "/m")
    assert same_host == []  # generators on the trainer's host map /dev/shm: no RDMA needed


def test_two_hosts_with_one_hostname_are_refused_unless_they_are_one_machine():
    hostnames_resolve_apart(
        [
            HostFacts("tcp://127.0.0.1:1", "vm", 0, (0, 1), "tcp", True),
            HostFacts("tcp://localhost:2", "vm", 0, (0, 1), "tcp", True),
        ]
    )
    with pytest.raises(ConfigError, match="both report hostname 'n'.*unique hostname"):
        hostnames_resolve_apart(
            [
                HostFacts("tcp://10.0.0.1:1", "n", 0, (0, 1), "tcp", True),
                HostFacts("tcp://10.0.0.2:1", "n", 0, (0, 1), "tcp", True),
            ]
        )


def test_reachability_is_checked_with_a_short_timeout_and_names_the_host():
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        open_address = f"tcp://127.0.0.1:{listening.getsockname()[1]}"
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            closed_address = f"tcp://127.0.0.1:{closed.getsockname()[1]}"  # bound, not listening
        check_reachable([open_address], timeout_s=1.0)
        started = time.monotonic()
        with pytest.raises(ConfigError) as error:
            check_reachable([open_address, closed_address], timeout_s=1.0)
    assert 1.0 - 0.3 < time.monotonic() - started < 2.5  # retried until the timeout, not longer
    message = str(error.value)
    assert closed_address in message and open_address not in message.split("within")[0]
    assert "forge-rl worker --port PORT" in message


def test_the_scorer_models_threads_count_on_the_services_host():
    """Reward-model replicas and the judge's engine run beside the scorer, on the services host:
    their threads count there, as preflight counts them on one machine."""
    launch = _list(2, trainer_hosts=(0,), generator_hosts=(1,))
    demand = RoleDemand(trainer_procs=1, reference_procs=0, num_generators=1, scorer_model_threads=4)
    check_host_facts(launch, demand, [_facts("a", cpus=2), _facts("b", cpus=2)], "/m")  # 5 threads on host 0's 2 cores
    heavy = dataclasses.replace(demand, scorer_model_threads=8)
    with pytest.raises(
        ConfigError, match=r"host 0 \(a.*1 trainer rank\(s\) \+ 1 scorer model\(s\) = 9 compute threads"
    ):
        check_host_facts(launch, heavy, [_facts("a", cpus=2), _facts("b", cpus=2)], "/m")


def test_a_scorer_host_takes_the_scorer_models_threads_off_the_services_host():
    launch = _list(3, trainer_hosts=(0,), generator_hosts=(1,), scorer_host=2)
    assert launch.placement.scorer_host_index == 2
    assert _list(2, services_host=1).placement.scorer_host_index == 1  # unset: the services' host
    demand = RoleDemand(trainer_procs=1, reference_procs=0, num_generators=1, scorer_model_threads=12)
    check_host_facts(launch, demand, [_facts("a", cpus=2), _facts("b", cpus=2), _facts("c", cpus=8)], "/m")
    with pytest.raises(ConfigError, match=r"host 2 \(c.*1 scorer model\(s\) = 12 compute threads"):
        check_host_facts(launch, demand, [_facts("a", cpus=8), _facts("b", cpus=8), _facts("c", cpus=2)], "/m")
    with pytest.raises(
        ConfigError, match=r"launch.placement.scorer_host \(\[3\]\) names host 3, but launch.workers has 3"
    ):
        _list(3, scorer_host=3)
    with pytest.raises(ConfigError, match=r"launch.placement.scorer_host \(\[1\]\) names a host other than 0"):
        LaunchConfig(placement=PlacementConfig(scorer_host=1))


def test_the_scorer_models_threads_are_counted_alike_by_preflight_and_placement(tmp_path):
    from forge_rl.config import GRPOConfig
    from forge_rl.plumbing.placement import demand_of
    from forge_rl.run.preflight import compute_threads
    from forge_rl.scoring.reward_model import RewardModelConfig
    from forge_rl.scoring.scorers import ScorerConfig

    (tmp_path / "config.json").write_text("{}")  # a model directory, as far as the config checks go
    config = GRPOConfig(scorer=ScorerConfig(reward_model=RewardModelConfig(path=tmp_path, replicas=3, num_threads=2)))
    assert demand_of(config).scorer_model_threads == 6
    assert "scorer.reward_model.replicas (3) x scorer.reward_model.num_threads (2)" in compute_threads(config)
