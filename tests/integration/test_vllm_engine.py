"""VLLMEngine against a real vLLM engine serving a tiny random Llama.

One engine serves the whole module: starting one takes 10-30 s on CPU. An AsyncLLM is bound to the
event loop that created it, so every test drives its coroutines on the module's loop.
The weight-swap tests change the engine's weights and run last (pytest keeps file order). They
swap while the engine is held mid-request (tests/support/held_engine.py): every request of the
batch has decoded HOLD_AFTER_TOKENS tokens and has the rest to go, by construction, not by timing.
"""

from __future__ import annotations

import asyncio
import functools
import re
import time
from pathlib import Path

import psutil
import pytest
import torch

from forge_rl.engines.config import GeneratorConfig
from forge_rl.engines.vllm_engine import VLLMEngine
from forge_rl.models.tiny import TinyModelConfig, create_tiny_model
from forge_rl.tasks.tokenizer import PromptTokenizer
from forge_rl.types import Completion, CompletionStatus, join_pieces
from tests.support.held_engine import HoldableEngine, start_held_batch

pytestmark = pytest.mark.integration

MAX_MODEL_LEN = 128
# Long enough that a weight swap lands mid-request; temperature != 1 and top_p < 1 check that the
# behaviour logprobs are those of the distribution sampled from: scaled, and renormalized over the
# kept set that every completion records.
# swap_kv="recompute": these tests check that every token's logprob is exactly that of the version
# it is labelled with; the default "reuse" is checked by its own test.
CONFIG = GeneratorConfig(max_new_tokens=48, temperature=0.8, top_p=0.9, swap_kv="recompute")
LOGPROB_ATOL = 1e-3
HOLD_AFTER_TOKENS = 5
"""Tokens every request of a swap test decodes on the old weights before the swap."""
SWAP_BATCH_PROMPTS = 32
"""x 4 samples + the holder fit one step (max_num_seqs 256), so all start together."""


class Served:
    """The module's engine, the loop it lives on, and the weights it started with."""

    def __init__(self, engine: VLLMEngine, loop: asyncio.AbstractEventLoop, model_dir: Path):
        self.engine = engine
        self.loop = loop
        self.model_dir = model_dir
        self.tokenizer = PromptTokenizer(model_dir)

    def run(self, coroutine):
        return self.loop.run_until_complete(coroutine)

    def prompts(self, count: int) -> list[list[int]]:
        return [self.tokenizer.encode_prompt(f"M{i % 10}{i * 7 % 10}=") for i in range(count)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model_dir = create_tiny_model(TinyModelConfig(), tmp_path_factory.mktemp("model"))
    loop = asyncio.new_event_loop()
    engine = HoldableEngine(CONFIG)
    # Earlier tests in this pytest process may have left long-lived helpers (wandb's service).
    before = {p.pid for p in spawned_processes()}
    loop.run_until_complete(engine.start(model_dir, MAX_MODEL_LEN))
    engine_processes = [p for p in spawned_processes() if p.pid not in before]
    assert engine_processes, "vLLM runs its engine core in-process; multiprocessing must be on"
    yield Served(engine, loop, model_dir)
    sockets_dir = Path(engine._ipc_dir)
    loop.run_until_complete(engine.shutdown())
    loop.close()
    _, alive = psutil.wait_procs(engine_processes, timeout=10)
    assert alive == [], f"engine processes outlived shutdown(): {alive}"
    assert not sockets_dir.exists(), f"the engine's socket directory {sockets_dir} outlived shutdown()"


def test_the_engines_sockets_are_in_a_directory_of_its_own(served):
    """vLLM's front end and engine core talk over ZMQ sockets that vLLM would leave in /tmp at
    every start; the engine gives them a directory that its shutdown removes (the fixture checks)."""
    sockets = list(Path(served.engine._ipc_dir).iterdir())
    assert sockets and all(path.is_socket() for path in sockets)


def spawned_processes() -> list[psutil.Process]:
    """This process's live descendants, less multiprocessing's resource tracker (it lives on)."""
    alive = []
    for process in psutil.Process().children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(process.cmdline()):
                alive.append(process)
        except (psutil.ZombieProcess, psutil.NoSuchProcess):  # exited, not yet reaped: not running
            pass
    return alive


@functools.cache
def hf_model(model_dir: Path):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()


def hf_logprobs(model_dir: Path, prompt: list[int], completion: Completion) -> list[float]:
    """log_softmax(logits / temperature) of the completion's tokens under `transformers`, fp32,
    over each token's recorded kept set (top-p)."""
    input_ids = torch.tensor([prompt + completion.token_ids])
    with torch.no_grad():
        logits = hf_model(model_dir)(input_ids).logits[0, len(prompt) - 1 : -1] / CONFIG.temperature
    return [
        (logits_V[token] - torch.logsumexp(logits_V[kept], dim=0)).item()
        for logits_V, token, kept in zip(logits, completion.token_ids, completion.sampling_support)
    ]


def test_config_errors_name_the_field_the_value_and_the_flag():
    expected = "generator.temperature (-1.0) must be >= 0 and finite (0: greedy, for evaluation only). Set --generator.temperature."
    with pytest.raises(ValueError, match=re.escape(expected)):
        GeneratorConfig(temperature=-1.0)


def test_generate_returns_n_completions_with_per_token_fields(served):
    completions = served.run(served.engine.generate(served.prompts(1)[0], n=6, eos_id=served.tokenizer.eos_id))

    assert len(completions) == 6
    for completion in completions:
        assert 1 <= completion.num_tokens <= CONFIG.max_new_tokens
        assert len(completion.logprobs) == len(completion.policy_versions) == completion.num_tokens
        assert all(logprob <= 0 for logprob in completion.logprobs)
        assert completion.policy_versions == [0] * completion.num_tokens
        if completion.status is CompletionStatus.OK:
            assert completion.token_ids[-1] == served.tokenizer.eos_id  # EOS kept for training
        else:
            assert completion.num_tokens == CONFIG.max_new_tokens


def test_the_engine_times_its_forward_passes_within_the_requests_wall_time(served):
    before = served.run(served.engine.forward_time())
    started = time.perf_counter()
    (completion,) = served.run(served.engine.generate(served.prompts(1)[0], n=1, eos_id=None))
    wall_s = time.perf_counter() - started
    after = served.run(served.engine.forward_time())
    # One prefill and a decode step per further token; eos_id None: every token is decoded.
    assert after["forward_steps"] - before["forward_steps"] >= completion.num_tokens
    assert 0 < after["forward_s"] - before["forward_s"] <= wall_s


def test_top_p_records_each_tokens_kept_set(served):
    completions = served.run(served.engine.generate(served.prompts(1)[0], n=8, eos_id=None))

    vocab_size = hf_model(served.model_dir).config.vocab_size
    for completion in completions:
        assert len(completion.sampling_support) == completion.num_tokens
        for token, kept in zip(completion.token_ids, completion.sampling_support):
            assert token in kept and len(set(kept)) == len(kept)
    sizes = [len(kept) for c in completions for kept in c.sampling_support]
    assert max(sizes) < vocab_size  # top_p = 0.9 cut something off


def test_behaviour_logprobs_match_transformers(served):
    prompt = served.prompts(1)[0]
    completions = served.run(served.engine.generate(prompt, n=4, eos_id=None))

    for completion in completions:
        expected = hf_logprobs(served.model_dir, prompt, completion)
        assert completion.logprobs == pytest.approx(expected, abs=LOGPROB_ATOL)


def test_a_group_decoded_in_segments_joins_into_completions_the_model_would_have_sampled(served):
    """Segments of 5 tokens of a 12-token budget (forced_length): 5, 5, then 2 that finish it;
    the joined completions' behaviour logprobs are the model's over the whole sequence, as if
    sampled in one request, and every token keeps its kept set and version."""
    prompt = served.prompts(1)[0]
    eos_id = served.tokenizer.eos_id
    first = served.run(served.engine.generate_segment(prompt, None, 3, eos_id, forced_length=12, segment_tokens=5))
    assert [(piece.num_tokens, done) for piece, done in first] == [(5, False)] * 3
    completions = [piece for piece, _ in first]
    for expected_tokens, expected_done in ((5, False), (2, True)):
        pieces = served.run(
            served.engine.generate_segment(
                prompt, [c.token_ids for c in completions], 1, eos_id, forced_length=12, segment_tokens=5
            )
        )
        assert [(piece.num_tokens, done) for piece, done in pieces] == [(expected_tokens, expected_done)] * 3
        completions = [join_pieces(c, piece) for c, (piece, _) in zip(completions, pieces)]
    for completion in completions:
        assert completion.num_tokens == 12 and completion.status is CompletionStatus.TRUNCATED
        assert completion.policy_versions == completion.kv_versions == [0] * 12
        assert len(completion.sampling_support) == 12
        assert all(token in kept for token, kept in zip(completion.token_ids, completion.sampling_support))
        assert completion.logprobs == pytest.approx(hf_logprobs(served.model_dir, prompt, completion), abs=LOGPROB_ATOL)


def test_too_long_prompt_is_rejected_before_submission(served):
    too_long = [served.tokenizer.bos_id] * (MAX_MODEL_LEN - CONFIG.max_new_tokens + 1)

    with pytest.raises(ValueError, match="max_model_len"):
        served.run(served.engine.generate(too_long, n=1, eos_id=None))


async def generate_and_swap(engine, prompts, weights_dir, policy_version, mode, swap_kv=None):
    """Start 4 samples of each prompt, hold the engine mid-request, swap: ((prompt, completion)s, stall).

    The version is staged first, so the swap itself is a pause and a reference swap (as in the
    run, where the generator stages while it decodes).
    """
    await engine.stage_weights(Path(weights_dir), policy_version)
    batch = await start_held_batch(engine, prompts, 4, HOLD_AFTER_TOKENS)
    stats = await engine.swap_weights(Path(weights_dir), policy_version, mode, swap_kv=swap_kv)
    assert stats.stage_s == 0.0  # staged before the batch: nothing staged inside the swap
    groups = await batch
    return [(p, c) for p, group in zip(prompts, groups) for c in group], stats.stall_s


def test_keep_mode_swap_stamps_tokens_decoded_after_it_with_the_new_version(served, tmp_path_factory):
    new_dir = create_tiny_model(TinyModelConfig(seed=1), tmp_path_factory.mktemp("model_v1"))
    sampled, stall_s = served.run(
        generate_and_swap(served.engine, served.prompts(SWAP_BATCH_PROMPTS), new_dir, policy_version=1, mode="keep")
    )
    print(f"keep-mode swap stall: {stall_s:.3f} s")

    assert stall_s < 2.0  # a pause and a reference swap; measured in milliseconds
    # Held after HOLD_AFTER_TOKENS tokens: every request has exactly those on the old weights.
    for _, completion in sampled:
        assert completion.num_tokens == CONFIG.max_new_tokens
        assert completion.policy_versions == [0] * HOLD_AFTER_TOKENS + [1] * (CONFIG.max_new_tokens - HOLD_AFTER_TOKENS)
        assert completion.kv_versions == completion.policy_versions  # the swap re-encoded their KV
    # Each token's logprob must come from the weights its version names: tokens decoded before the
    # pause from the old model, tokens after it from the new one (prefix recomputed on resume).
    for prompt, completion in sampled[:8]:
        old = hf_logprobs(served.model_dir, prompt, completion)
        new = hf_logprobs(new_dir, prompt, completion)
        expected = [o if v == 0 else n for o, n, v in zip(old, new, completion.policy_versions)]
        assert completion.logprobs == pytest.approx(expected, abs=LOGPROB_ATOL)
        assert max(abs(o - n) for o, n in zip(old, new)) > 10 * LOGPROB_ATOL  # swap is visible

    prompt = served.prompts(1)[0]
    for completion in served.run(served.engine.generate(prompt, n=2, eos_id=None)):
        assert completion.policy_versions == [1] * completion.num_tokens
        assert completion.logprobs == pytest.approx(hf_logprobs(new_dir, prompt, completion), abs=LOGPROB_ATOL)


def test_wait_mode_swap_lets_in_flight_requests_finish_on_the_old_weights(served, tmp_path_factory):
    new_dir = create_tiny_model(TinyModelConfig(seed=2), tmp_path_factory.mktemp("model_v2"))
    sampled, stall_s = served.run(
        generate_and_swap(served.engine, served.prompts(16), new_dir, policy_version=2, mode="wait")
    )
    print(f"wait-mode swap stall (drain included): {stall_s:.3f} s")

    # Every request was mid-decode at the swap (held there): all finish on version 1.
    assert all(c.policy_versions == [1] * CONFIG.max_new_tokens for _, c in sampled)
    assert served.engine.policy_version == 2


def test_a_swap_keeping_the_kv_continues_in_flight_requests_and_serves_new_ones_exactly(served, tmp_path_factory):
    """swap_kv="reuse" (the default): tokens before the swap are the old model's, later ones are
    sampled by the new weights over the old KV (no recompute), and a request submitted after the
    swap never reuses a prefix-cache block of the old weights (requests are salted by version)."""
    new_dir = create_tiny_model(TinyModelConfig(seed=3), tmp_path_factory.mktemp("model_v3"))
    version = served.engine.policy_version + 1
    before = served.engine.policy_version
    sampled, stall_s = served.run(
        generate_and_swap(
            served.engine,
            served.prompts(SWAP_BATCH_PROMPTS),
            new_dir,
            policy_version=version,
            mode="keep",
            swap_kv="reuse",
        )
    )
    assert stall_s < 2.0  # a pause and a reference swap; measured in milliseconds
    for _, completion in sampled:
        assert completion.policy_versions == (
            [before] * HOLD_AFTER_TOKENS + [version] * (CONFIG.max_new_tokens - HOLD_AFTER_TOKENS)
        )
        assert completion.kv_versions == [before] * CONFIG.max_new_tokens  # later tokens attend to its KV
    prompt = served.prompts(1)[0]
    for completion in served.run(served.engine.generate(prompt, n=2, eos_id=None)):
        assert completion.policy_versions == [version] * completion.num_tokens
        assert completion.logprobs == pytest.approx(hf_logprobs(new_dir, prompt, completion), abs=LOGPROB_ATOL)


def test_a_real_judge_answering_garbage_errors_and_counts_every_completion(served):
    """The tiny random model as an LLM judge (forge_rl/scoring/judge.py) on the module's engine: its verdicts
    hold no score, so every completion is ERRORED, counted as unparsable, and scoring goes on."""
    from forge_rl.scoring.judge import JudgeConfig, judge_client
    from forge_rl.scoring.score_writer import ScoreWriter
    from forge_rl.scoring.scorers import JudgeScorer
    from forge_rl.types import Episode

    async def generate(episodes, group_size):  # GeneratorActor.generate, on this module's engine
        for episode in episodes:
            episode.completions = await served.engine.generate(
                episode.prompt_token_ids, group_size, served.tokenizer.eos_id
            )
            for completion in episode.completions:
                completion.text = served.tokenizer.decode(completion.token_ids)
        return episodes

    config = JudgeConfig(template="{prompt}{completion}=", prompt_format="plain", timeout_s=120)
    stage = ScoreWriter(JudgeScorer(config, judge_client(served.tokenizer, "plain", generate)))
    completions = [Completion(token_ids=[5], logprobs=[-1.0], policy_versions=[0], text=t) for t in "7305"]
    (episode,) = served.run(stage.score([Episode(0, "M37=", "7", served.prompts(1)[0], completions)]))
    assert [c.status for c in episode.completions] == [CompletionStatus.ERRORED] * 4
    assert all(c.error.startswith("unparsable verdict") for c in episode.completions)
    stats = stage.stats()
    assert (stats["scorer/verdicts"], stats["scorer/unparsable"], stats["scorer/errored"]) == (4, 4, 4)
