"""Benchmarks: `forge-rl bench ...` commands that print and save their figures."""
