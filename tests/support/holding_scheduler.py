"""The scheduler of `HoldableEngine` (tests/support/held_engine.py), run by the engine-core process."""

from __future__ import annotations

from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.scheduler import Scheduler

from tests.support.held_engine import HOLD_PROMPT


class HoldingScheduler(Scheduler):
    """vLLM's scheduler, which also pauses the engine ("keep") when a `HOLD_PROMPT` request finishes.

    Runs in the engine-core process (`scheduler_cls`), so it is found by its import path.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._holder_ids: set[str] = set()

    def add_request(self, request) -> None:
        if list(request.prompt_token_ids or []) == HOLD_PROMPT:
            self._holder_ids.add(request.request_id)
        super().add_request(request)

    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        finished = {
            output.request_id
            for engine_outputs in outputs.values()
            for output in engine_outputs.outputs
            if output.finish_reason is not None
        }
        if finished & self._holder_ids:
            self._holder_ids -= finished
            # Outputs of this step are already made and carry the old version; the next
            # schedule() returns nothing until resume_scheduler().
            self.set_pause_state(PauseState.PAUSED_ALL)
        return outputs
