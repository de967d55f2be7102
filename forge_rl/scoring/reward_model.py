"""A learned reward model as a scorer: a Hugging Face sequence-classification model (a local
directory, nothing from a hub) that reads prompt + completion and returns one scalar.

    RewardBatcher       gathers concurrent requests into batches of up to max_batch_size texts
    SequenceClassifier  the model itself: tokenizer + AutoModelForSequenceClassification, one forward
    train_reward_model  a tiny reward model trained from scratch on a synthetic task's correctness labels

`forge_rl.scoring.scorers.RewardModelScorer` is the scorer, calling the model through a client. The
model runs in its own actor on its own processes (`forge_rl.actors.reward_model`), so it scales
apart from the generators and its faults stay there. A non-finite score (a NaN from the model)
marks that completion ERRORED and is counted, like any scorer failure.

No Monarch here; transformers is imported only where a model is loaded or trained.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal


@dataclass(frozen=True)
class RewardModelConfig:
    path: Path | None = None
    """HF directory of a sequence-classification model with one label (config.json, safetensors,
    tokenizer.json); `forge-rl train-reward-model` writes a tiny one. Unset: no reward model."""
    weight: float = 1.0
    """Its weight in the reward: reward = scorer.reward_fn_weight * verifier + weight * model score."""
    output: Literal["logit", "probability"] = "logit"
    """The model's score as is (logit), or sigmoid(logit) in [0, 1] (probability), for a model
    trained as a correctness classifier (`forge-rl train-reward-model`)."""
    max_batch_size: int = 64
    """Most texts per forward pass; concurrent requests are gathered up to this."""
    max_wait_ms: float = 2.0
    """How long a request waits for others to fill a batch when the model is idle (a busy model
    gathers everything that arrived during the previous forward, with no wait)."""
    num_threads: int = 1
    """Torch CPU threads of each reward-model process."""
    replicas: int = 1
    """Reward-model processes, each holding the model and batching its own requests; the scorer
    sends each call to the one with the fewest calls in flight. Scales the reward model apart from
    the generators (their count is num_generators)."""

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(
                f"scorer.reward_model.replicas ({self.replicas}) must be >= 1. Set --scorer.reward-model.replicas."
            )
        if self.max_batch_size < 1:
            raise ValueError(
                f"scorer.reward_model.max_batch_size ({self.max_batch_size}) must be >= 1. "
                "Set --scorer.reward-model.max-batch-size."
            )
        if not 0 <= self.max_wait_ms < math.inf:
            raise ValueError(
                f"scorer.reward_model.max_wait_ms ({self.max_wait_ms}) must be >= 0 and finite. "
                "Set --scorer.reward-model.max-wait-ms."
            )
        if not math.isfinite(self.weight):
            raise ValueError(
                f"scorer.reward_model.weight ({self.weight}) must be finite. Set --scorer.reward-model.weight."
            )
        if self.path is not None and not (Path(self.path) / "config.json").is_file():
            raise ValueError(
                f"scorer.reward_model.path ({self.path}) holds no config.json: it must be a Hugging Face "
                "sequence-classification model directory. Train a tiny one with `forge-rl train-reward-model "
                "--out DIR`, or unset --scorer.reward-model.path."
            )


def reward_model_input(prompt_text: str, completion_text: str) -> str:
    """What the reward model reads: the prompt followed by the completion, as it was trained."""
    return prompt_text + completion_text


class RewardBatcher:
    """Gathers concurrent `score` calls into forwards of up to `max_batch_size` texts.

    One loop runs the model; a call's texts join the next batch. While the model is busy, requests
    pile up and go together into the next forward; when it is idle, the first request waits up to
    `max_wait_s` for company. A batch that raises fails the calls it held (each caller sees the
    error), never the batcher."""

    def __init__(self, forward: Callable[[list[str]], list[float]], max_batch_size: int, max_wait_s: float):
        self.forward = forward
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self._pending: list[tuple[str, asyncio.Future]] = []
        self._arrived = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self.num_batches = 0
        self.num_texts = 0

    async def score(self, texts: list[str]) -> list[float]:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.create_task(self._run())
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in texts]
        self._pending.extend(zip(texts, futures))
        self._arrived.set()
        return list(await asyncio.gather(*futures))

    async def _run(self) -> None:
        while True:
            await self._arrived.wait()
            if len(self._pending) < self.max_batch_size and self.max_wait_s > 0:
                await asyncio.sleep(self.max_wait_s)
            batch, self._pending = self._pending[: self.max_batch_size], self._pending[self.max_batch_size :]
            if not self._pending:
                self._arrived.clear()
            if not batch:
                continue
            try:
                # In this thread on purpose: the model's process serves only this model, and a
                # forward in a thread pool would only add a handoff per batch.
                values = self.forward([text for text, _ in batch])
                if len(values) != len(batch):
                    raise RuntimeError(f"the reward model returned {len(values)} scores for {len(batch)} texts")
            except Exception as e:
                for _, future in batch:
                    if not future.done():
                        future.set_exception(e)
                continue
            self.num_batches += 1
            self.num_texts += len(batch)
            for (_, future), value in zip(batch, values):
                if not future.done():
                    future.set_result(float(value))


class SequenceClassifier:
    """A local HF sequence-classification model with one label; `forward(texts)` is its scalar per text."""

    def __init__(self, model_dir: Path, output: Literal["logit", "probability"] = "logit", num_threads: int = 1):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        torch.set_num_threads(num_threads)
        self.output = output
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(
                f"the reward model at {model_dir} has {self.model.config.num_labels} labels; a reward model "
                "returns one scalar per text (num_labels = 1)."
            )

    def forward(self, texts: list[str]) -> list[float]:
        import torch

        inputs = model_inputs(self.tokenizer, texts)
        with torch.inference_mode():
            logits_B = self.model(**inputs).logits[:, 0].float()
        return (torch.sigmoid(logits_B) if self.output == "probability" else logits_B).tolist()


def model_inputs(tokenizer, texts: list[str]):
    """Token ids of `texts` for the classifier, each ending with EOS, right-padded. The model's
    score is read at the last real token, so EOS gives it one fixed place to gather the whole text
    (a text's own last character is arbitrary), as in training."""
    return tokenizer([text + tokenizer.eos_token for text in texts], return_tensors="pt", padding=True)


# A tiny reward model for the synthetic tasks --------------------------------------------------


def synthetic_reward_examples(task: str, seed: int, count: int) -> list[tuple[str, float]]:
    """(prompt + completion, correctness label) pairs for `task`, labelled by the task's verifier
    (`forge_rl.tasks.synthetic.leading_number_reward`). Completions cover what a policy can
    sample there: 40% are the answer, alone or followed by one non-digit; 60% are any one or two
    characters of the alphabet (what a fresh policy emits, mostly wrong). A policy trained on the
    model pushes wherever the model errs, so the wrong answers must cover its whole support, not
    only near misses: a first version that drew wrong completions from a narrower mix was hacked
    (docs/scoring.md)."""
    from forge_rl.tasks.synthetic import leading_number_reward, make_prompt
    from forge_rl.tasks.tokenizer import ALPHABET

    rng = random.Random(f"reward-model:{task}:{seed}")
    non_digits = [c for c in ALPHABET if not c.isdigit()]
    examples = []
    for index in range(count):
        prompt = make_prompt(task, seed, index)
        if rng.random() < 0.4:
            completion = prompt.answer + (rng.choice(non_digits) if rng.random() < 0.5 else "")
        else:
            completion = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 2)))
        examples.append((reward_model_input(prompt.text, completion), leading_number_reward(completion, prompt.answer)))
    return examples


@dataclass(frozen=True)
class RewardModelTraining:
    """`forge-rl train-reward-model`: a tiny reward model for a synthetic task, from scratch."""

    out: Path = Path("runs/reward_model")
    """Directory the model is written to (then --scorer.reward-model.path OUT)."""
    task: str = "max_of_two"
    """Synthetic task whose verifier labels the examples (max_of_two, copy_digit, add_mod10)."""
    num_examples: int = 8192
    """Training examples (prompt + completion, 0/1 label); 512 more are held out for accuracy."""
    steps: int = 1000
    """Optimizer steps (AdamW)."""
    batch_size: int = 64
    learning_rate: float = 1e-3
    hidden_size: int = 64
    num_layers: int = 2
    seed: int = 0


def train_reward_model(training: RewardModelTraining = RewardModelTraining()) -> dict:
    """Create a tiny Llama sequence classifier with the character tokenizer from scratch, fit it
    to the task's correctness labels (binary cross-entropy on its logit), save it to `training.out`;
    returns {train_s, heldout_accuracy, ...}. Tens of seconds on a CPU with the defaults."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    from forge_rl.tasks import tokenizer as char_tokenizer

    started = time.perf_counter()
    out_dir = Path(training.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    char_tokenizer.save_char_tokenizer(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    torch.manual_seed(training.seed)
    model = LlamaForSequenceClassification(
        LlamaConfig(
            vocab_size=char_tokenizer.VOCAB_SIZE,
            hidden_size=training.hidden_size,
            intermediate_size=2 * training.hidden_size,
            num_hidden_layers=training.num_layers,
            num_attention_heads=training.hidden_size // 32,
            num_key_value_heads=training.hidden_size // 32,
            head_dim=32,
            max_position_embeddings=128,
            num_labels=1,
            pad_token_id=tokenizer.pad_token_id,
            torch_dtype="float32",
        )
    )
    examples = synthetic_reward_examples(training.task, training.seed, training.num_examples + 512)
    train, heldout = examples[: training.num_examples], examples[training.num_examples :]
    optimizer = torch.optim.AdamW(model.parameters(), lr=training.learning_rate)
    rng = random.Random(training.seed)

    def logits(batch: list[tuple[str, float]]) -> torch.Tensor:
        return model(**model_inputs(tokenizer, [text for text, _ in batch])).logits[:, 0]

    model.train()
    loss = torch.tensor(math.nan)
    for _ in range(training.steps):
        batch = rng.sample(train, training.batch_size)
        labels = torch.tensor([label for _, label in batch])
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits(batch), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.inference_mode():
        predicted = (logits(heldout) > 0).float()
    accuracy = (predicted == torch.tensor([label for _, label in heldout])).float().mean().item()
    model.save_pretrained(out_dir, safe_serialization=True)
    return {
        "train_s": time.perf_counter() - started,
        "heldout_accuracy": accuracy,
        "final_loss": loss.item(),
        "path": str(out_dir),
    }
