"""Policy-gradient losses as plain functions of per-token tensors. See `grpo.py`."""
