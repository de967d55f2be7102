"""Policy-gradient losses and off-policy corrections as plain functions of per-token tensors.

`policy.py` holds the entry point (`policy_loss`, `LossConfig`); `corrections.py` the IS weights and
masks it applies.
"""
