import gc

from forge_rl.gc_freeze import frozen_startup_objects


def test_objects_alive_at_the_start_are_frozen_for_the_block_and_collectable_after():
    assert gc.get_freeze_count() == 0
    with frozen_startup_objects():
        assert gc.get_freeze_count() > 0
        made_later = [[] for _ in range(3)]
        assert all(gc.is_tracked(obj) for obj in made_later)
    assert gc.get_freeze_count() == 0
