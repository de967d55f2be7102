"""Fake environment factories that read a data row, for the tests of environments over data files
(environment.name = "tests.support.row_envs:fake_secret_env")."""

from forge_rl.envs.environment import StepResult

made_with: list[tuple[int, int, dict | None]] = []
"""(seed, index, row) of every environment the factories here made, in order."""


class FakeSecretEnv:
    """One turn: the prompt names the row's secret, and saying it back scores 1.0."""

    def __init__(self, secret: str):
        self.secret = secret

    async def reset(self):
        return f"S{self.secret}="

    async def step(self, turn_text):
        return StepResult(done=True, final_reward=float(turn_text.strip() == self.secret))


def fake_secret_env(seed: int, index: int, row: dict) -> FakeSecretEnv:
    made_with.append((seed, index, row))
    return FakeSecretEnv(str(row["secret"]))


def fake_secret_env_or_default(seed: int, index: int, row: dict | None = None) -> FakeSecretEnv:
    made_with.append((seed, index, row))
    return FakeSecretEnv("7" if row is None else str(row["secret"]))
