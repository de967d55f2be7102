"""TRL's side of `forge-rl bench peers`: one GRPOTrainer run, started by the bench as
`VENV/bin/python peer_trl.py SPEC.json` in TRL's own virtual environment (`make peers-venv`).

A file of the package rather than a script beside it: the bench finds it next to itself wherever
forge_rl is installed, and the settings it reads (one JSON spec the bench writes from the recipe's
config) stay beside the code that writes them. It imports nothing of forge_rl as a package: TRL's
environment holds none of forge_rl's dependencies (TRL pins a transformers that vLLM's pins
exclude). The reward is the task's own function (the spec's `reward_function`, e.g.
`leading_number_reward`), loaded from the file the spec names (the task module imports only the
standard library), so both libraries score alike.

With the spec's `chat`, each prompt is one user message (TRL renders it with the model's chat
template, as forge_rl's `prompt_format: chat` does); with its `lora`, PEFT adapters of that rank,
alpha and target modules train on the frozen model (`peft`, pinned in TRL's environment).

Per step it appends one JSON line to the spec's `metrics_path`: the step, seconds since training
began (`on_train_begin`, after the model, the data and the trainer are built), the step's mean
reward, its completion tokens and TRL's own step time. The first line records the Unix time
training began, from which the bench takes the start-up time. The run stops at `max_steps` or
once `budget_s` seconds have passed since training began.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time


def load_reward(path: str, name: str):
    spec = importlib.util.spec_from_file_location("_peer_task", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load a Python module from {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return getattr(module, name)


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    import torch

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    reward_fn = load_reward(spec["reward_module"], spec["reward_function"])
    with open(spec["prompts_path"]) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if spec[
        "chat"
    ]:  # one user message, rendered by the model's chat template with the assistant header, as forge_rl does
        prompts = [[{"role": "user", "content": r["prompt"]}] for r in rows]
    else:  # the prompt as forge_rl encodes it: the tokenizer's bos, then the text
        prompts = [spec["prompt_prefix"] + r["prompt"] for r in rows]
    dataset = Dataset.from_list([{"prompt": prompt, "answer": r["answer"]} for prompt, r in zip(prompts, rows)])

    def reward(completions, answer, **_):
        # A conversational prompt's completion comes as its messages: the assistant's one reply.
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        return [reward_fn(t, a) for t, a in zip(texts, answer)]

    out = open(spec["metrics_path"], "w")
    state = {"start": None}

    class StepLog(TrainerCallback):
        def on_train_begin(self, args, trainer_state, control, **kwargs):
            state["start"] = time.monotonic()
            out.write(json.dumps({"train_begin_unix_time": time.time()}) + "\n")
            out.flush()

        def on_log(self, args, trainer_state, control, logs=None, **kwargs):
            if not logs or "reward" not in logs:
                return
            out.write(
                json.dumps(
                    {
                        "step": trainer_state.global_step,
                        "wall_time_s": time.monotonic() - state["start"],
                        "reward": logs["reward"],
                        "completion_tokens": logs["completions/mean_length"] * spec["completions_per_step"],
                        "step_time_s": logs.get("step_time"),
                    }
                )
                + "\n"
            )
            out.flush()

        def on_step_end(self, args, trainer_state, control, **kwargs):
            if time.monotonic() - state["start"] >= spec["budget_s"]:
                control.should_training_stop = True

    config = GRPOConfig(
        output_dir=spec["output_dir"],
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=spec["completions_per_step"],
        gradient_accumulation_steps=1,
        num_generations=spec["group_size"],
        max_completion_length=spec["max_new_tokens"],
        temperature=spec["temperature"],
        top_p=spec["top_p"],
        top_k=spec["top_k"],
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=spec["weight_decay"],
        adam_epsilon=spec["adam_eps"],
        max_grad_norm=spec["max_grad_norm"],
        loss_type=spec["loss_type"],
        epsilon=spec["clip_eps_low"],
        epsilon_high=spec["clip_eps_high"],
        beta=spec["kl_beta"],
        num_iterations=1,
        scale_rewards="group",
        max_steps=spec["max_steps"],
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=spec["seed"],
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    peft_config = None
    if spec["lora"] is not None:
        from peft import LoraConfig

        lora = spec["lora"]
        peft_config = LoraConfig(
            r=lora["r"],
            lora_alpha=lora["alpha"],
            target_modules=lora["target_modules"],
            lora_dropout=0.0,
            bias="none",
            task_type="CAUSAL_LM",
        )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepLog()],
        peft_config=peft_config,
    )
    trainer.train()
    out.close()


if __name__ == "__main__":
    main(sys.argv[1])
