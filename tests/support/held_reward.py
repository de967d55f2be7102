"""A reward function the scorer-recovery test can hold (task.reward = "tests.support.held_reward:held_leading_number").

While the file `hold` exists in the directory named by $FORGE_TEST_SCORER_HOLD_DIR, each call marks
`held-<pid>` there and waits until `hold` is gone: the test knows a scoring call is in flight, and
kills the scorer under it. Otherwise it is the demo task's own reward (leading_number).
"""

import os
import time
from pathlib import Path

from forge_rl.tasks.synthetic import leading_number_reward

HOLD_DIR_ENV = "FORGE_TEST_SCORER_HOLD_DIR"


def held_leading_number(completion_text: str, answer: str) -> float:
    hold_dir = Path(os.environ[HOLD_DIR_ENV])
    if (hold_dir / "hold").exists():
        (hold_dir / f"held-{os.getpid()}").touch()
        while (hold_dir / "hold").exists():
            time.sleep(0.01)
    return leading_number_reward(completion_text, answer)
