"""CPU-seconds of a whole process tree, start-up included: what the side-by-side benches count.

    python -m tests.bench.proctree [--grace S] OUT.json -- COMMAND ...

runs COMMAND as a child of a small wrapper process that is the tree's *subreaper*
(``prctl(PR_SET_CHILD_SUBREAPER)``): a descendant whose parent exits (a daemon that double-forks, Ray's
raylet and GCS once the driver is gone, a fork server's workers) is re-parented to the wrapper instead
of to init, so the wrapper reaps it and the kernel adds its CPU to the wrapper's
``getrusage(RUSAGE_CHILDREN)``. A child's own reaped children are already in its figure when the wrapper
reaps it, so once every descendant is reaped that figure is the CPU of every process the command ever
started, however deep, except the children of a parent that ignores SIGCHLD (the kernel reaps them and
their CPU reaches nobody: Ray's workers' training went uncounted so). The polls below also keep each
descendant's own CPU as last seen; ``cpu_s`` is the larger of the two sums (``cpu_reaped_s``,
``cpu_polled_s``). After COMMAND exits, the wrapper waits ``--grace`` seconds for the rest of the
tree to exit, then terminates (SIGTERM, then SIGKILL) what is left, by pid, and reaps it too.

While it runs the wrapper polls ``/proc`` (``--poll`` seconds) for the live descendants: the most at once
(``peak_procs``) and each command name seen (``names``), so a report can say what each system ran.
OUT.json: ``{"cpu_s", "cpu_reaped_s", "cpu_polled_s", "wall_s", "rc", "peak_procs", "names", "leftover",
"t_launch"}`` (``t_launch``: the
``time.time()`` the command was started; ``leftover``: descendants that had to be terminated).

``run_counted`` starts the wrapper and returns its figures as a ``TreeUsage``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36


@dataclass(frozen=True)
class TreeUsage:
    cpu_s: float  # user + system seconds of every process of the tree, start-up to exit
    wall_s: float  # from the command's start to the last descendant's exit
    rc: int
    peak_procs: int  # most descendants alive at once (the command included)
    names: dict[str, int]  # command name -> distinct pids seen with it
    leftover: int  # descendants still alive after the grace period (terminated)
    t_launch: float  # time.time() when the command was started


def descendants(parents: Mapping[int, int], root: int) -> set[int]:
    """Every pid below ``root`` in a ``pid -> ppid`` table (``root`` itself not included)."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    out: set[int] = set()
    todo = list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        if pid in out:
            continue
        out.add(pid)
        todo.extend(children.get(pid, ()))
    return out


CLK_TCK = os.sysconf("SC_CLK_TCK")


def parse_stat(raw: str) -> tuple[str, int, float]:
    """``(comm, ppid, own cpu s)`` from the text of ``/proc/<pid>/stat`` (the name may hold spaces and
    parens)."""
    comm = raw[raw.index("(") + 1 : raw.rindex(")")]
    fields = raw[raw.rindex(")") + 2 :].split()
    cpu = (int(fields[11]) + int(fields[12])) / CLK_TCK if len(fields) > 12 else 0.0
    return comm, int(fields[1]), cpu


def process_table() -> dict[int, tuple[str, int, float]]:
    """``pid -> (comm, ppid, own cpu s)`` of every live process."""
    out: dict[int, tuple[str, int, float]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                out[int(name)] = parse_stat(f.read())
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    return out


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _reap_all() -> bool:
    """Reap every exited child without blocking; True while some child is still alive."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True


class _Watch:
    """The live descendants at each poll: the most at once, their names, and each one's own CPU as last
    seen (the children of a parent that ignores SIGCHLD are reaped by the kernel, and their CPU reaches
    nobody's ``RUSAGE_CHILDREN``: the polls see it while they live)."""

    def __init__(self) -> None:
        self.peak = 0
        self.seen: dict[int, str] = {}
        self.cpu: dict[int, float] = {}

    def poll(self) -> set[int]:
        table = process_table()
        live = descendants({p: pp for p, (_, pp, _) in table.items()}, os.getpid())
        live = {p for p in live if p in table}
        self.peak = max(self.peak, len(live))
        for p in live:
            self.seen.setdefault(p, table[p][0])
            self.cpu[p] = max(self.cpu.get(p, 0.0), table[p][2])
        return live

    def names(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for name in self.seen.values():
            out[name] = out.get(name, 0) + 1
        return dict(sorted(out.items()))


def wrap(command: Sequence[str], out: Path, *, grace_s: float = 10.0, poll_s: float = 0.2) -> int:
    """The wrapper's body (see the module doc)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")
    cpu0 = _children_cpu()
    watch = _Watch()
    t_launch = time.time()
    t0 = time.perf_counter()
    child = subprocess.Popen(list(command))
    rc: int | None = None
    while rc is None:
        watch.poll()
        with contextlib.suppress(subprocess.TimeoutExpired):
            rc = child.wait(timeout=poll_s)
    deadline = time.monotonic() + grace_s
    leftover = 0
    while _reap_all():
        live = watch.poll()
        if time.monotonic() >= deadline:
            leftover = len(live)
            for sig in (signal.SIGTERM, signal.SIGKILL):
                for pid in live:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, sig)
                time.sleep(1.0)
                _reap_all()
                live = watch.poll()
            while _reap_all():
                time.sleep(0.05)
            break
        time.sleep(poll_s)
    wall = time.perf_counter() - t0
    reaped = _children_cpu() - cpu0
    polled = sum(watch.cpu.values())
    figures = {
        # the reaped figure misses what the kernel reaped for a parent that ignores SIGCHLD, the polled one
        # what ran between two polls: each is a lower bound, the larger the closer
        "cpu_s": round(max(reaped, polled), 3),
        "cpu_reaped_s": round(reaped, 3),
        "cpu_polled_s": round(polled, 3),
        "wall_s": round(wall, 3),
        "rc": rc,
        "peak_procs": watch.peak,
        "names": watch.names(),
        "leftover": leftover,
        "t_launch": t_launch,
    }
    out.write_text(json.dumps(figures))
    return 0


def run_counted(
    command: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    timeout_s: float = 3600.0,
    grace_s: float = 10.0,
    stdout: int | None = None,
) -> TreeUsage:
    """Run ``command`` under the wrapper; its tree's figures. The wrapper's own CPU is not counted."""
    with tempfile.TemporaryDirectory(prefix="proctree-") as tmp:
        out = Path(tmp) / "usage.json"
        wrapper = [sys.executable, "-m", "tests.bench.proctree", "--grace", str(grace_s), str(out), "--", *command]
        root = str(Path(__file__).resolve().parents[2])
        full_env = dict(os.environ if env is None else env)
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, full_env.get("PYTHONPATH")]))
        subprocess.run(wrapper, env=full_env, cwd=cwd, timeout=timeout_s, check=True, stdout=stdout)
        o = json.loads(out.read_text())
    return TreeUsage(
        float(o["cpu_s"]),
        float(o["wall_s"]),
        int(o["rc"]),
        int(o["peak_procs"]),
        dict(o["names"]),
        int(o["leftover"]),
        float(o["t_launch"]),
    )


def summary(names: Mapping[str, int], top: int = 8) -> str:
    """``name x count`` of the most frequent command names, for a report line."""
    items: Iterable[tuple[str, int]] = sorted(names.items(), key=lambda kv: (-kv[1], kv[0]))
    return ", ".join(f"{n} x{c}" if c > 1 else n for n, c in list(items)[:top])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.bench.proctree", description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--grace", type=float, default=10.0, help="seconds the tree may outlive the command")
    p.add_argument("--poll", type=float, default=0.2)
    p.add_argument("command", nargs=argparse.REMAINDER)
    ns = p.parse_args(argv)
    command = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
    if not command:
        p.error("no command after --")
    return wrap(command, ns.out, grace_s=ns.grace, poll_s=ns.poll)


if __name__ == "__main__":
    sys.exit(main())
