"""Workers are forked without the node manager's ``__main__``, and only they: a process another thread
spawns meanwhile (a user's ``multiprocessing`` code) keeps it, and nothing in ``multiprocessing`` is
replaced outside a launch."""

from __future__ import annotations

import threading
from multiprocessing import spawn

from stagetree.nodemanager import workers

MAIN_KEYS = {"init_main_from_name", "init_main_from_path"}


def test_only_the_launching_thread_drops_the_main_module() -> None:
    original = spawn.get_preparation_data
    assert original.__module__ == "multiprocessing.spawn"  # importing workers replaced nothing
    plain = set(original("p"))
    assert plain & MAIN_KEYS  # pytest runs as a main module
    launching, entered, done = {}, threading.Event(), threading.Event()

    def launcher() -> None:
        with workers._without_main():
            entered.set()
            launching["keys"] = set(spawn.get_preparation_data("w"))
            done.wait(10)

    t = threading.Thread(target=launcher)
    t.start()
    entered.wait(10)
    meanwhile = set(spawn.get_preparation_data("other"))  # another thread, while the launch is on
    done.set()
    t.join(10)
    assert not launching["keys"] & MAIN_KEYS
    assert meanwhile == plain and launching["keys"] == plain - MAIN_KEYS
    assert spawn.get_preparation_data is original  # put back when the launch returned


def test_concurrent_launches_take_turns_and_put_the_original_back() -> None:
    original = spawn.get_preparation_data
    seen: list[set[str]] = []

    def launch() -> None:
        for _ in range(50):
            with workers._without_main():
                seen.append(set(spawn.get_preparation_data("w")))

    threads = [threading.Thread(target=launch) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(seen) == 200 and not any(keys & MAIN_KEYS for keys in seen)
    assert spawn.get_preparation_data is original
