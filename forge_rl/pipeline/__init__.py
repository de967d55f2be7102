"""The run's data plane: rollouts on the generators, the admission gate and the buffer, batches for the trainer."""
