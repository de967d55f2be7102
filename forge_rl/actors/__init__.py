"""Monarch actor shells: each owns one core object, exposes async endpoints, translates failures.

This folder and `launch.py` are the only places that import Monarch.
"""
