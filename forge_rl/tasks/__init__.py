"""Tasks: prompt generators with exact verifiers. See `synthetic.py`."""
