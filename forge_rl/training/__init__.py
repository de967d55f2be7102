"""The policy trainer on TorchTitan, its config and steps, the losses, the frozen reference and the warm-up."""
