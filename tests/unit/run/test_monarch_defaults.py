"""forge_rl's Monarch settings reach every process it spawns as environment defaults, and a user's
own setting wins."""

import os

from forge_rl.run.launch import MONARCH_DEFAULTS, set_monarch_defaults

SPAWN_IDLE = "HYPERACTOR_MESH_PROC_SPAWN_MAX_IDLE"


def test_the_defaults_are_set_where_the_environment_has_none(monkeypatch):
    monkeypatch.delenv(SPAWN_IDLE, raising=False)
    set_monarch_defaults()
    assert os.environ[SPAWN_IDLE] == MONARCH_DEFAULTS[SPAWN_IDLE]


def test_a_users_own_setting_wins(monkeypatch):
    monkeypatch.setenv(SPAWN_IDLE, "45s")
    set_monarch_defaults()
    assert os.environ[SPAWN_IDLE] == "45s"
