"""The functional core of the data path: the buffer, admission, advantages, batches in columns and packed rows,
prompts, accounting, checkpoint files. Plain Python and PyTorch: no Monarch, vLLM or TorchTitan."""
