"""The benches' CPU counting (``tests.bench.proctree``): every process of a tree is counted, including a
daemon that left its parent, and whatever outlives the grace period is ended and counted too."""

from __future__ import annotations

import os
import sys
import textwrap

from tests.bench.proctree import descendants, parse_stat, run_counted, summary

# A parent that forks a grandchild which double-forks away (re-parented: the wrapper is the subreaper),
# each burning a known amount of its own CPU, then exits at once.
_TREE = textwrap.dedent(
    """
    import os, sys, time

    def burn(s):
        t = time.process_time()
        while time.process_time() - t < s:
            pass

    if os.fork() == 0:          # the middle process
        if os.fork() == 0:      # the daemon: its parent exits before it does
            burn(0.4)
            if len(sys.argv) > 1:
                time.sleep(float(sys.argv[1]))
            os._exit(0)
        os._exit(0)
    burn(0.2)
    """
)


def test_descendants_follow_the_parent_table() -> None:
    table = {2: 1, 3: 2, 4: 3, 5: 1, 6: 99}
    assert descendants(table, 1) == {2, 3, 4, 5}
    assert descendants(table, 3) == {4}
    assert descendants(table, 7) == set()


def test_parse_stat_takes_names_with_spaces_and_parens() -> None:
    raw = "42 (ray::IDLE (x)) S 7 42 42 0 -1 4194304 100 0 0 0 250 50 0 0 20 0 1 0"
    comm, ppid, cpu = parse_stat(raw)
    assert (comm, ppid) == ("ray::IDLE (x)", 7)
    assert cpu == (250 + 50) / os.sysconf("SC_CLK_TCK")


def test_a_daemon_that_left_its_parent_is_counted() -> None:
    usage = run_counted([sys.executable, "-c", _TREE], grace_s=30.0)
    assert usage.rc == 0
    assert usage.leftover == 0
    assert usage.cpu_s >= 0.6  # both burns (and the interpreter's start-up)
    assert usage.wall_s > 0


# A parent that ignores SIGCHLD: the kernel reaps its child, whose CPU reaches no RUSAGE_CHILDREN.
_IGNORING = textwrap.dedent(
    """
    import os, signal, time
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    if os.fork() == 0:
        t = time.process_time()
        while time.process_time() - t < 1.0:
            pass
        os._exit(0)
    time.sleep(1.0)
    while True:  # until the kernel has reaped the child
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
    """
)


def test_a_child_of_a_parent_that_ignores_sigchld_is_counted_by_the_polls() -> None:
    usage = run_counted([sys.executable, "-c", _IGNORING], grace_s=30.0)
    assert usage.rc == 0
    assert usage.cpu_s >= 0.7  # the child's second, less what ran after the last poll


def test_what_outlives_the_grace_period_is_ended_and_counted() -> None:
    usage = run_counted([sys.executable, "-c", _TREE, "600"], grace_s=0.5)
    assert usage.rc == 0
    assert usage.leftover == 1
    assert usage.cpu_s >= 0.2  # the parent's burn (the daemon's is counted up to where it was ended)


def test_summary_lists_the_most_frequent_names() -> None:
    assert summary({"python": 3, "raylet": 1, "gcs_server": 1}, top=2) == "python x3, gcs_server"
