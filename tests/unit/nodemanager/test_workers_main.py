"""Workers are forked without the node manager's ``__main__``, and only they: a process another thread
spawns meanwhile (a user's ``multiprocessing`` code) keeps it."""

from __future__ import annotations

import threading
from multiprocessing import spawn

from stagetree.nodemanager import workers

MAIN_KEYS = {"init_main_from_name", "init_main_from_path"}


def test_only_the_launching_thread_drops_the_main_module() -> None:
    assert spawn.get_preparation_data is workers._preparation_data  # installed once, at import
    plain = set(spawn.get_preparation_data("p"))
    assert plain & MAIN_KEYS  # pytest runs as a main module
    launching, entered, done = {}, threading.Event(), threading.Event()

    def launcher() -> None:
        workers._WITHOUT_MAIN.on = True
        try:
            entered.set()
            launching["keys"] = set(spawn.get_preparation_data("w"))
            done.wait(10)
        finally:
            workers._WITHOUT_MAIN.on = False

    t = threading.Thread(target=launcher)
    t.start()
    entered.wait(10)
    meanwhile = set(spawn.get_preparation_data("other"))  # another thread, while the launch is on
    done.set()
    t.join(10)
    assert not launching["keys"] & MAIN_KEYS
    assert meanwhile == plain and launching["keys"] == plain - MAIN_KEYS
