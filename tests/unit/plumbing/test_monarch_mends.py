"""forge_rl/plumbing/monarch_mends.py: a second thread pickling a message while torchmonarch builds its
torch-aware pickler waits for it instead of calling a pickler that is still None."""

from __future__ import annotations

import io
import pickle
import sys
import threading

import pytest
from monarch._src.actor import pickle as monarch_pickle

from forge_rl.plumbing.monarch_mends import make_torch_pickling_thread_safe

WAIT_S = 60.0  # a bound for a failing test only: each wait ends on an event


@pytest.fixture
def slow_build(monkeypatch):
    """torchmonarch's lazy build of its pickler with its order kept (marked built, then built), held
    inside until released: a fake of `_ensure_torch_pickle` that lets a test put a second thread
    into the window a loaded machine opens."""
    entered, release = threading.Event(), threading.Event()
    built_pickler = monarch_pickle._TorchPickler or type("TorchPickler", (monarch_pickle.cloudpickle.Pickler,), {})

    def fake_monarch_build() -> None:
        if monarch_pickle._torch_pickle_initialized:
            return
        monarch_pickle._torch_pickle_initialized = True
        entered.set()
        assert release.wait(WAIT_S)
        monarch_pickle._TorchPickler = built_pickler

    monkeypatch.setattr(monarch_pickle, "_TorchPickler", None)
    monkeypatch.setattr(monarch_pickle, "_torch_pickle_initialized", False)
    monkeypatch.setattr(monarch_pickle, "_ensure_torch_pickle", fake_monarch_build)
    return entered, release


def dump_in_a_thread(results: dict, name: str) -> threading.Thread:
    def dump() -> None:
        buffer = io.BytesIO()
        try:
            monarch_pickle.torch_dump({"sent_by": name}, buffer)
            results[name] = pickle.loads(buffer.getvalue())
        except Exception as error:  # noqa: BLE001 - the test reads what each thread met
            results[name] = error

    thread = threading.Thread(target=dump, name=name)
    thread.start()
    return thread


def wait_until_inside(thread: threading.Thread, function_name: str) -> None:
    """Until `thread` runs `function_name` (or ended): the state to check, reached, not guessed."""
    done = threading.Event()
    for _ in range(int(WAIT_S / 0.01)):
        frame = sys._current_frames().get(thread.ident)
        while frame is not None and frame.f_code.co_name != function_name:
            frame = frame.f_back
        if frame is not None or not thread.is_alive():
            return
        done.wait(0.01)
    raise AssertionError(f"{thread.name} never reached {function_name}")


def test_torchmonarch_alone_lets_a_second_thread_call_a_pickler_not_yet_built(slow_build):
    entered, release = slow_build
    results: dict = {}
    first = dump_in_a_thread(results, "first")
    assert entered.wait(WAIT_S)
    second = dump_in_a_thread(results, "second")
    second.join(WAIT_S)
    release.set()
    first.join(WAIT_S)
    assert isinstance(results["second"], TypeError) and "not callable" in str(results["second"])
    assert results["first"] == {"sent_by": "first"}


def test_with_the_mend_the_second_thread_waits_for_the_build_and_both_messages_pickle(slow_build):
    entered, release = slow_build
    make_torch_pickling_thread_safe()
    make_torch_pickling_thread_safe()  # installed once however often it is asked
    assert monarch_pickle._ensure_torch_pickle.forge_rl_locked
    results: dict = {}
    first = dump_in_a_thread(results, "first")
    assert entered.wait(WAIT_S)
    second = dump_in_a_thread(results, "second")
    wait_until_inside(second, "ensure_torch_pickle")
    assert second.is_alive()  # waiting on the build, not past it
    release.set()
    first.join(WAIT_S)
    second.join(WAIT_S)
    assert results == {"first": {"sent_by": "first"}, "second": {"sent_by": "second"}}
