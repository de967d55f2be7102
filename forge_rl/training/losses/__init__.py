"""Policy-gradient losses and off-policy corrections as plain functions of per-token tensors.

`policy.py` holds the entry point (`policy_loss`); `corrections.py` the IS weights and masks it
applies; `config.py` their settings (`LossConfig`), without torch.
"""
