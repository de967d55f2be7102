"""GRPO as a loop of your own on the Tinker API, against `forge-rl serve`: the demo's task
("M37=" -> "7": the larger digit) learned from scratch by a LoRA tenant, one sampling batch ahead
of training.

    forge-rl serve --port 8000 --trainer.lora.rank 16 --base-model forge-rl/tiny
    python examples/grpo_loop.py --base-url http://127.0.0.1:8000 --steps 300

Asynchrony is this loop's choice: its sampling client is "inflight", following the tenant's newest
saved weights, and the next step's samples are in flight while this step trains, so each batch was
sampled by weights at most one step old; the importance-sampling loss weighs each token by the
ratio of the trainer's probability to the sampler's (the logprobs each sample came with). The
last stdout line is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import numpy as np
import tinker


def max_of_two(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randrange(10), rng.randrange(10)
    return f"M{a}{b}=", str(max(a, b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--base-model", default="forge-rl/tiny")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    client = tinker.ServiceClient(base_url=args.base_url, api_key="tml-local")
    training = client.create_lora_training_client(base_model=args.base_model, rank=args.rank, seed=args.seed).result()
    tokenizer = training.get_tokenizer()
    sampler = training.save_weights_and_get_sampling_client(kind="inflight").result()
    params = tinker.SamplingParams(max_tokens=2, temperature=1.0)  # a digit, then EOS
    rng = random.Random(args.seed)

    def submit_batch():
        batch = []
        for prompt, answer in (max_of_two(rng) for _ in range(args.prompts_per_step)):
            tokens = tokenizer.encode(prompt, add_special_tokens=False)
            future = sampler.sample(tinker.ModelInput.from_ints(tokens), args.group_size, params)
            batch.append((tokens, answer, future))
        return batch

    started, rewards_by_step = time.perf_counter(), []
    pending = submit_batch()
    for step in range(1, args.steps + 1):
        batch, pending = pending, submit_batch()  # the next batch samples while this one trains
        datums, rewards = [], []
        for prompt_tokens, answer, future in batch:
            sequences = future.result().sequences
            group = [float(tokenizer.decode(s.tokens, skip_special_tokens=True).strip() == answer) for s in sequences]
            rewards += group
            mean, std = statistics.fmean(group), statistics.pstdev(group)
            if std == 0:  # every sample scored alike: no signal
                continue
            for sequence, reward in zip(sequences, group):
                advantage = (reward - mean) / (std + 1e-6)  # GRPO's, within the group
                tokens, n = prompt_tokens + list(sequence.tokens), len(prompt_tokens) - 1
                datums.append(
                    tinker.Datum(
                        model_input=tinker.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={
                            "target_tokens": np.array(tokens[1:], dtype=np.int64),
                            "logprobs": np.array([0.0] * n + list(sequence.logprobs), dtype=np.float32),
                            "advantages": np.array([0.0] * n + [advantage] * len(sequence.tokens), dtype=np.float32),
                        },
                    )
                )
        if datums:
            training.forward_backward(datums, "importance_sampling")
            training.optim_step(tinker.AdamParams(learning_rate=args.learning_rate)).result()
        training.save_weights_and_get_sampling_client(kind="inflight").result()  # the sampler follows
        rewards_by_step.append(statistics.fmean(rewards))
        print(
            json.dumps(
                {
                    "step": step,
                    "reward": rewards_by_step[-1],
                    "datums": len(datums),
                    "elapsed_s": round(time.perf_counter() - started, 1),
                }
            ),
            flush=True,
        )
    final = statistics.fmean(rewards_by_step[-5:])
    print(
        json.dumps(
            {
                "steps": args.steps,
                "first_reward": rewards_by_step[0],
                "final_reward": final,
                "elapsed_s": round(time.perf_counter() - started, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
