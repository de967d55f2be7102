"""`forge-rl serve` for real, driven by the official Tinker SDK as a user's loop would: the command
in its own process (trainer rank, vLLM engine, weight store, HTTP server) on a tiny model, and
`tinker.ServiceClient` here.

What is checked: a short session (create, forward_backward, optim_step, save for the sampler,
sample) whose training reaches the sampler (greedy samples of the trained continuation); two
tenants on the one base, each sampled with its own adapter; refused requests naming their fault;
Ctrl-C stopping every process of the service."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from tests.support.helpers import sigint_handled

tinker = pytest.importorskip("tinker")

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
START_S = 300
"""Most seconds the service may take to listen (engine start on a loaded machine)."""
RANK = 8
PROMPT = [1, 14, 9, 7, 40]
SEQUENCES = {"a": [21, 22, 23, 24], "b": [30, 29, 28, 27]}
"""What each tenant learns to continue PROMPT with."""
ADAM = tinker.AdamParams(learning_rate=3e-3, beta1=0.9, beta2=0.95, eps=1e-8)


def _wait_for_server(process: subprocess.Popen, server_file: Path, log: Path) -> dict:
    """The service's server.json once it listens; fails with the log's tail if the process ends."""
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if server_file.is_file():
            return json.loads(server_file.read_text())
        if process.poll() is not None:
            pytest.fail(f"forge-rl serve exited with {process.returncode}:\n{log.read_text()[-4000:]}")
        time.sleep(0.2)  # polling a file another process writes once: no event to wait on
    process.kill()
    pytest.fail(f"forge-rl serve did not listen within {START_S} s:\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("serve")
    log = run_dir / "serve.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "forge_rl.cli",
                "serve",
                "--port",
                "0",
                "--run-dir",
                str(run_dir),
                "--run-name",
                "svc",
                "--trainer.lora.rank",
                str(RANK),
                "--base-model",
                "forge-rl/tiny",
                "--generator.max-num-seqs",
                "8",
                "--log.tensorboard",
            ],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=sigint_handled,
        )
    info = _wait_for_server(process, run_dir / "svc" / "server.json", log)
    yield {"url": info["url"], "process": process, "dir": run_dir / "svc", "log": log}
    if process.poll() is None:
        process.kill()
        process.wait(timeout=60)


@pytest.fixture(scope="module")
def client(service):
    client = tinker.ServiceClient(base_url=service["url"], api_key="tml-local")
    yield client
    if service["process"].poll() is None:  # its heartbeats would otherwise go on after the server
        client.close("success").result(timeout=60)


def _datum(sequence: list[int]) -> tinker.Datum:
    """PROMPT then `sequence`, the loss on `sequence` only (Tinker's shift: input i predicts target i)."""
    tokens = PROMPT + sequence
    weights = [0.0] * (len(PROMPT) - 1) + [1.0] * len(sequence)
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.array(tokens[1:], dtype=np.int64),
            "weights": np.array(weights, dtype=np.float32),
        },
    )


def _greedy(sampler) -> list[int]:
    params = tinker.SamplingParams(max_tokens=len(SEQUENCES["a"]), temperature=0.0, stop=[])
    result = sampler.sample(prompt=tinker.ModelInput.from_ints(PROMPT), num_samples=1, sampling_params=params).result()
    return list(result.sequences[0].tokens)


def _teach(training, sequence: list[int], steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        result = training.forward_backward([_datum(sequence)], "cross_entropy").result()
        training.optim_step(ADAM).result()
        losses.append(result.metrics["loss:sum"])
    return losses


def test_a_short_session_trains_and_the_sampler_serves_what_it_learned(client, service):
    capabilities = client.get_server_capabilities()  # the cookbook's call (the SDK now also has RestClient's)
    assert [m.model_name for m in capabilities.supported_models] == ["forge-rl/tiny"]
    training = client.create_lora_training_client(base_model="forge-rl/tiny", rank=RANK).result()
    forward = training.forward([_datum(SEQUENCES["a"])], "cross_entropy").result()
    logprobs = forward.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert logprobs.shape == (len(PROMPT) + len(SEQUENCES["a"]) - 1,) and (logprobs <= 0).all()

    losses = _teach(training, SEQUENCES["a"], steps=25)
    assert losses[-1] < 0.1 * losses[0], losses  # the adapters include the unembedding (train_unembed)

    sampler = training.save_weights_and_get_sampling_client()
    assert _greedy(sampler) == SEQUENCES["a"]
    # The sampler's logprobs are the trainer's, on the same weights.
    sampled = sampler.sample(
        prompt=tinker.ModelInput.from_ints(PROMPT),
        num_samples=3,
        sampling_params=tinker.SamplingParams(max_tokens=4, temperature=1.0, stop=[]),
    ).result()
    assert len(sampled.sequences) == 3 and all(len(s.tokens) == 4 and len(s.logprobs) == 4 for s in sampled.sequences)
    prompt_logprobs = sampler.compute_logprobs(tinker.ModelInput.from_ints(PROMPT + SEQUENCES["a"])).result()
    trained = (
        training.forward([_datum(SEQUENCES["a"])], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    )
    assert prompt_logprobs[0] is None
    np.testing.assert_allclose(prompt_logprobs[len(PROMPT) :], trained[len(PROMPT) - 1 :], atol=0.05)

    metrics = [
        json.loads(line)
        for line in (service["dir"] / "tenants" / training.model_id / "metrics.jsonl").read_text().splitlines()
    ]
    assert [m["step"] for m in metrics] == list(range(1, 26)) and all(m["grad_norm"] > 0 for m in metrics)


def _descending_and_consistent(rows, tokens, logprobs) -> None:
    """Each row likeliest first; where the position's own token is among its top k, its logprob
    is that entry's, and no own token is likelier than the row's first."""
    for row, token, logprob in zip(rows, tokens, logprobs):
        values = [lp for _, lp in row]
        assert values == sorted(values, reverse=True) and np.logaddexp.reduce(values) <= 1e-4, row
        assert logprob <= values[0] + 1e-4, (row, token, logprob)
        own = dict(row).get(token)
        if own is not None:
            assert abs(own - logprob) < 1e-4, (row, token, logprob)


def test_top_k_logprobs_of_the_prompt_and_of_each_sampled_token_come_from_the_engine(client):
    sampler = client.create_sampling_client(base_model="forge-rl/tiny")
    k = 3
    result = sampler.sample(
        prompt=tinker.ModelInput.from_ints(PROMPT),
        num_samples=2,
        sampling_params=tinker.SamplingParams(max_tokens=4, temperature=1.0, stop=[], seed=3),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=k,
        topk_sample_logprobs=k,
    ).result()
    prompt_rows = result.topk_prompt_logprobs
    assert len(prompt_rows) == len(PROMPT) and prompt_rows[0] is None
    assert all(len(row) == k for row in prompt_rows[1:])
    _descending_and_consistent(prompt_rows[1:], PROMPT[1:], result.prompt_logprobs[1:])
    for sequence in result.sequences:
        assert len(sequence.topk_logprobs) == len(sequence.tokens) == 4
        assert all(len(row) == k for row in sequence.topk_logprobs)
        _descending_and_consistent(sequence.topk_logprobs, sequence.tokens, sequence.logprobs)
    # Sampled with top_k=2, a position's distribution holds two tokens: its rows list those alone.
    narrow = (
        sampler.sample(
            prompt=tinker.ModelInput.from_ints(PROMPT),
            num_samples=1,
            sampling_params=tinker.SamplingParams(max_tokens=3, temperature=1.0, top_k=2, stop=[], seed=3),
            topk_sample_logprobs=k,
        )
        .result()
        .sequences[0]
    )
    assert all(len(row) == 2 and abs(np.logaddexp.reduce([lp for _, lp in row])) < 1e-3 for row in narrow.topk_logprobs)
    assert all(token in dict(row) for token, row in zip(narrow.tokens, narrow.topk_logprobs))
    # Prompts scored while other samples decode, on the engine's LoRA path: each answer whole.
    decoding = [
        sampler.sample(
            prompt=tinker.ModelInput.from_ints(PROMPT),
            num_samples=2,
            sampling_params=tinker.SamplingParams(max_tokens=8, temperature=1.0, stop=[]),
        )
        for _ in range(3)
    ]
    scored = [sampler.compute_logprobs(tinker.ModelInput.from_ints(PROMPT + SEQUENCES["a"])) for _ in range(2)]
    assert all(len(f.result().sequences) == 2 for f in decoding)
    assert all(len(f.result()) == len(PROMPT + SEQUENCES["a"]) for f in scored)


def test_the_docs_example_runs_as_written(service):
    """docs/service.md's session, with the URL this test's service listens on."""
    doc = (REPO / "docs" / "service.md").read_text()
    example = re.search(r"```python\n(.*?)```", doc, re.S).group(1)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(example.replace("http://127.0.0.1:8000", service["url"]), {})
    assert printed.getvalue().strip().splitlines()[-1] == str(SEQUENCES["a"])


def test_two_tenants_on_one_base_each_sample_with_their_own_adapter(client):
    tenants = {
        name: client.create_lora_training_client(base_model="forge-rl/tiny", rank=RANK).result() for name in SEQUENCES
    }
    for _ in range(25):  # interleaved: each step of one tenant between two of the other
        for name, training in tenants.items():
            training.forward_backward([_datum(SEQUENCES[name])], "cross_entropy").result()
            training.optim_step(ADAM).result()
    samplers = {name: training.save_weights_and_get_sampling_client() for name, training in tenants.items()}
    for name, sampler in samplers.items():
        assert _greedy(sampler) == SEQUENCES[name], name
    base = client.create_sampling_client(base_model="forge-rl/tiny")
    assert _greedy(base) not in SEQUENCES.values()


def test_an_inflight_sampler_follows_the_newest_save_and_a_snapshot_stays(client, service):
    training = client.create_lora_training_client(base_model="forge-rl/tiny", rank=RANK).result()
    inflight = training.save_weights_and_get_sampling_client(kind="inflight").result()
    snapshot = training.save_weights_and_get_sampling_client().result()
    untrained = _greedy(snapshot)
    assert _greedy(inflight) == untrained
    _teach(training, SEQUENCES["b"], steps=25)
    training.save_weights_and_get_sampling_client(kind="inflight").result()  # moves every inflight client
    assert _greedy(inflight) == SEQUENCES["b"]
    assert _greedy(snapshot) == untrained
    # The tenant's step figures went to its dashboard too (--log.tensorboard).
    assert any((service["dir"] / "tenants" / training.model_id / "tensorboard").iterdir())


def test_a_tenant_that_trains_attention_alone_learns_less_than_one_that_trains_every_layer(client):
    losses = {}
    for name, flags in {"attention": dict(train_mlp=False, train_unembed=False), "every layer": {}}.items():
        training = client.create_lora_training_client(base_model="forge-rl/tiny", rank=RANK, **flags).result()
        losses[name] = _teach(training, SEQUENCES["b"], steps=15)[-1]
    assert losses["every layer"] < losses["attention"], losses


def test_the_grpo_loop_example_runs_against_the_service(service):
    """examples/grpo_loop.py, a few steps (its learning is measured in docs/service.md, not here)."""
    loop = subprocess.run(
        [
            sys.executable,
            str(REPO / "examples" / "grpo_loop.py"),
            "--base-url",
            service["url"],
            "--steps",
            "3",
            "--prompts-per-step",
            "4",
            "--rank",
            str(RANK),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert loop.returncode == 0, loop.stderr[-3000:]
    summary = json.loads(loop.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 3 and 0.0 <= summary["final_reward"] <= 1.0


def test_a_saved_state_loads_back_into_its_tenant_and_into_a_new_one(client, service):
    training = client.create_lora_training_client(base_model="forge-rl/tiny", rank=RANK).result()
    probe = [_datum(SEQUENCES["a"])]

    def logprobs(model) -> np.ndarray:
        return model.forward(probe, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()

    _teach(training, SEQUENCES["a"], steps=5)
    saved = training.save_state("five").result()
    at_save = logprobs(training)
    _teach(training, SEQUENCES["b"], steps=5)
    assert not np.allclose(logprobs(training), at_save, atol=1e-4)
    training.load_state_with_optimizer(saved.path).result()
    np.testing.assert_allclose(logprobs(training), at_save, atol=1e-5)
    # The same weights and moments: one more step from either lands in the same place.
    copy = client.create_training_client_from_state_with_optimizer(saved.path).result()
    np.testing.assert_allclose(logprobs(copy), at_save, atol=1e-5)
    for model in (training, copy):
        _teach(model, SEQUENCES["a"], steps=1)
    np.testing.assert_allclose(logprobs(copy), logprobs(training), atol=1e-5)
    listed = (
        tinker.RestClient(base_url=service["url"], api_key="tml-local").list_checkpoints(training.model_id).result()
    )
    assert [(c.checkpoint_type, c.tinker_path) for c in listed.checkpoints] == [("training", saved.path)]


def test_bad_requests_are_refused_naming_their_fault(client):
    training = client.create_lora_training_client(base_model="forge-rl/tiny", rank=RANK).result()
    with pytest.raises(Exception, match="gspo.*cross_entropy|cross_entropy.*gspo"):
        training.forward_backward([_datum(SEQUENCES["a"])], "gspo").result()
    with pytest.raises(Exception, match="rank"):
        client.create_lora_training_client(base_model="forge-rl/tiny", rank=RANK * 2).result()
    too_long = tinker.Datum(
        model_input=tinker.ModelInput.from_ints([1] * 400),
        loss_fn_inputs={"target_tokens": np.ones(400, dtype=np.int64), "weights": np.ones(400, dtype=np.float32)},
    )
    with pytest.raises(Exception, match="context"):
        training.forward_backward([too_long], "cross_entropy").result()


def test_a_sample_survives_its_generator_dying_and_the_replacement_serves_the_adapter(client, service):
    training = client.create_lora_training_client(base_model="forge-rl/tiny", rank=RANK).result()
    _teach(training, SEQUENCES["a"], steps=25)
    sampler = training.save_weights_and_get_sampling_client().result()
    assert _greedy(sampler) == SEQUENCES["a"]
    generator_pid = json.loads((service["dir"] / "processes.json").read_text())["generators"][0][0]
    os.kill(generator_pid, signal.SIGKILL)
    with contextlib.suppress(psutil.NoSuchProcess):
        psutil.Process(generator_pid).wait(timeout=30)
    # The pool replaces the generator; the sample waits for it, and the new engine loads the
    # adapter from the weight store: the same greedy continuation.
    assert _greedy(sampler) == SEQUENCES["a"]


def test_ctrl_c_stops_the_server_and_every_process_of_the_service(service, client):
    client.close("success").result(timeout=60)  # the session ends before its server does
    # Every process of the service descends from the command's (Monarch's, vLLM's engines).
    descendants = psutil.Process(service["process"].pid).children(recursive=True)
    assert len(descendants) >= 3
    service["process"].send_signal(signal.SIGINT)
    assert service["process"].wait(timeout=120) == 0, service["log"].read_text()[-3000:]
    _, alive = psutil.wait_procs(descendants, timeout=30)
    assert not alive, [p.pid for p in alive]
    summary = json.loads(service["log"].read_text().strip().splitlines()[-1])
    assert summary["service_dir"] == str(service["dir"])
    # The service directory stays (each tenant's metrics); the server file goes with the server.
    assert not (service["dir"] / "server.json").exists() and (service["dir"] / "tenants").is_dir()
