"""Values packed as the C pickler's bytes (forge_rl/plumbing/wire.py) cross Monarch's message pickler as one
object and arrive as themselves."""

import dataclasses

from monarch._src.actor.pickle import flatten, unflatten

from forge_rl.core.columns import BatchColumns, batch_columns
from forge_rl.plumbing.wire import packed
from forge_rl.training.trainer_steps import PulledBatch
from forge_rl.types import Completion, CompletionStatus, Episode
from tests.support.fakes import completions_for


def crossed(value) -> tuple[object, list[type]]:
    """`value` through Monarch's message pickler and back, and the type of every object it met."""
    seen = []
    _, buffer = flatten(value, lambda obj: seen.append(type(obj)) or False)
    return unflatten(buffer.freeze(), []), seen


def test_a_scored_group_and_its_batch_cross_as_one_bytes_object_and_arrive_as_themselves():
    prompt = Episode(
        episode_id=7, prompt_text="M37=", answer="7", prompt_token_ids=[1, 2, 3], generator_index=1, admitted_version=4
    )
    episodes = [dataclasses.replace(prompt, completions=completions_for(prompt, 8, 4))]
    episodes[0].completions[1].status = CompletionStatus.ERRORED
    episodes[0].completions[2].sampling_support = [[5, 6], [2]]
    batch = PulledBatch(train_version=5, columns=batch_columns(episodes), ready_s=12.5)

    for value in (episodes, (0, episodes, 8), batch):
        arrived, seen = crossed(packed(value))
        assert arrived == value
        assert seen.count(bytes) == 1
        assert not {Episode, Completion, BatchColumns, PulledBatch, list} & set(seen)


def test_a_few_numbers_go_as_they_are():
    value = (3, 17, "/dev/shm/weights/v17")
    assert packed(value) is value


def test_what_the_c_pickler_refuses_goes_as_it_is_through_monarchs_pickler():
    def local_function(x):
        return x + 1

    value = (local_function, [1, 2])
    assert packed(value) is value
    arrived, _ = crossed(packed(value))
    assert arrived[0](1) == 2 and arrived[1] == [1, 2]
