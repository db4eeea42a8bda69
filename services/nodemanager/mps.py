"""The CUDA MPS control daemon of one node manager (HyperSack §IV-C: packing trials on a GPU).

With MPS, the workers that share a GPU run their kernels concurrently instead of time-slicing, and each
is capped by ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` (set per slot, see ``slots.worker_env``). The node
manager starts its own daemon, with its pipe and log directories under its work dir so two node
managers (or a system daemon) never share one, and stops it on exit::

    start:  CUDA_MPS_PIPE_DIRECTORY=<work>/mps/pipe CUDA_MPS_LOG_DIRECTORY=<work>/mps/log nvidia-cuda-mps-control -d
    stop:   echo quit | nvidia-cuda-mps-control      (same environment)

Workers get the same two directory variables, which is how a CUDA client finds its daemon.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from stagetree.core.errors import FailedPrecondition

log = logging.getLogger(__name__)

CONTROL = "nvidia-cuda-mps-control"
# A unix socket path must fit in sockaddr_un (108 bytes); MPS appends its own names to the pipe dir.
MAX_PIPE_DIR = 80


class MpsDaemon:
    """Start/stop one MPS control daemon for ``gpu_indices`` with state under ``work_dir/mps``."""

    def __init__(self, work_dir: Path, gpu_indices: Sequence[int], *, control: str = CONTROL) -> None:
        self.pipe_dir = work_dir / "mps" / "pipe"
        self.log_dir = work_dir / "mps" / "log"
        self.gpu_indices = tuple(gpu_indices)
        self.control = control
        self.running = False

    def client_env(self) -> dict[str, str]:
        """What a worker needs to reach this daemon."""
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir), "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir)}

    def daemon_env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env.update(self.client_env())
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in self.gpu_indices)
        return env

    def start_command(self) -> list[str]:
        return [self.control, "-d"]

    def stop_command(self) -> tuple[list[str], str]:
        """The command and what to write on its stdin."""
        return [self.control], "quit\n"

    def start(self) -> None:
        """Start the daemon; FailedPrecondition (with what to do) when it cannot run here."""
        if len(str(self.pipe_dir)) > MAX_PIPE_DIR:
            raise FailedPrecondition(
                f"MPS pipe directory {self.pipe_dir} is too long for a unix socket; use a shorter STAGETREE_NM_WORK_DIR"
            )
        if shutil.which(self.control) is None:
            raise FailedPrecondition(
                f"{self.control} is not on PATH; install the CUDA toolkit's MPS tools or set STAGETREE_NM_MPS=false"
            )
        self.pipe_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        res = subprocess.run(
            self.start_command(), env=self.daemon_env(), capture_output=True, text=True, timeout=30, check=False
        )
        if res.returncode != 0:
            raise FailedPrecondition(
                f"{self.control} -d exited {res.returncode}: {(res.stderr or res.stdout).strip()} "
                f"(see {self.log_dir}/control.log)"
            )
        self.running = True
        log.info("MPS daemon started", extra={"pipe_dir": str(self.pipe_dir), "gpus": list(self.gpu_indices)})

    def stop(self) -> None:
        """Ask the daemon to quit (it waits for its clients to exit); no-op when not started."""
        if not self.running:
            return
        cmd, stdin = self.stop_command()
        try:
            res = subprocess.run(
                cmd, env=self.daemon_env(), input=stdin, capture_output=True, text=True, timeout=30, check=False
            )
            if res.returncode != 0:
                log.warning("MPS daemon did not quit cleanly: %s", res.stderr.strip(), extra={"rc": res.returncode})
        except (OSError, subprocess.TimeoutExpired) as e:
            log.warning("MPS daemon stop failed: %s", e)
        self.running = False
        log.info("MPS daemon stopped", extra={"pipe_dir": str(self.pipe_dir)})
