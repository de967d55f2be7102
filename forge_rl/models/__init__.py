"""Models: the tiny from-scratch factory (`tiny.py`) and the TorchTitan bridge (`titan.py`)."""
