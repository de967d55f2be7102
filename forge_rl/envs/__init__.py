"""Multi-turn environments and token-in/token-out trajectories: the functional core (no Monarch, no
vLLM, no torch) that the rollout shell runs beside the generators.

    environment.py   the interface: async reset / step, StepResult, MalformedTurn
    trajectory.py    spans (generated or context), samples, statuses, the builder
    renderers.py     conversation -> token ids: chat template, or the tiny models' plain format
    graph.py         episode graphs: several agents (seats) in one episode, each with a view of its own
    runner.py        run_graph, run_episode: one episode within its limits, over any `generate` coroutine
    calculator.py    calculator tool for the tiny models (products of two-digit numbers)
    python_tool.py   Python tool for chat models, running code in the sandbox
    selfplay.py      proposer/solver self-play for the tiny models (two seats; solvers as OpenAI-style agent code in selfplay_chat)
    long_tail.py     heavy-tailed turns and latencies: the workload of `forge-rl bench multi-turn`
    demonstrations.py  well-formed episodes for the supervised warm-up (`forge_rl.training.warmup`)
    chat_client.py   agent code written against openai.AsyncOpenAI, served in process by the generator
    openenv_adapter.py    OpenEnv environments (openenv), in process
    verifiers_adapter.py  verifiers environments, played by verifiers' own chat program
    verifiers_sums.py     a small verifiers taskset (sums) for the tiny models
    sandbox.py       untrusted code in a confined process: what it guarantees and what it does not

On the real engine, the runner's `generate` is `VLLMEngine.generate_turn`
(`forge_rl.engines.vllm_engine`), which this package does not import.
docs/environments.md shows a custom environment, how episodes run on the engine, and what the
sandbox guarantees.
"""
