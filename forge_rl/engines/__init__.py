"""Inference engines that sample rollouts. See `vllm_engine.py`."""
