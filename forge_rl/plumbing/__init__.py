"""Processes and Monarch: the spawned processes' entry point, mends for torchmonarch, reaping, exit,
memory hygiene, values on the wire, replies of mesh calls, placement of processes on hosts."""
