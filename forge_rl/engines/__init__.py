"""Inference engines that sample rollouts: the `Engine` protocol (`engine.py`) and the two engines that meet it, vLLM's (`vllm_engine.py`) and the simulated one (`simulated.py`)."""
