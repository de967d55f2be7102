"""Versioned weight store between trainer and generators. See `shm.py`."""
