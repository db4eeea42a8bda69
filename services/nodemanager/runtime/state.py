"""How a trainer's state becomes a checkpoint directory and back.

Layout of a checkpoint directory::

    user/          what the trainer's ``save`` wrote (``trainer.pt`` for the default save)
    runtime.pt     the runtime's part: RNG states, the point, a format version

A batch on several ranks (``runtime.distributed``) is saved by rank 0, with every rank's RNG state
(``rng_ranks``, by rank; ``rng`` is rank 0's), so each rank of a resume on the same number of ranks
continues its own streams exactly. A resume on another number of ranks is refused unless the trainer
class is ``rescalable`` (each rank then starts from rank 0's streams); ``restore_checkpoint`` says how
many ranks wrote the checkpoint, so the worker can report the resume and the master record the plan's
path change.

A ``Snapshot`` is the same state held in memory, detached from the live trainer: every tensor is
copied (to CPU), every container rebuilt, so training may go on while a thread writes it. A *pack* is
one directory holding the snapshots of many points (``pack.pt``: ``"<node>:<step>"`` -> snapshot), the
in-memory snapshots a batch kept of a small model at every step; every point of it is cataloged with
the pack's uri, and a restore takes the batch's source point out of it. Restores
always read from the store, never from a shared in-memory object: ``Optimizer.load_state_dict`` keeps
references to the tensors it is given, so two trainers restored from one object would share their
momentum buffers.
"""

from __future__ import annotations

import copy
import logging
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from stagetree.core.batch import Point
from stagetree.core.errors import FailedPrecondition
from stagetree.nodemanager.runtime.checkpoints import CheckpointStore
from stagetree.nodemanager.runtime.trainer import (
    USER_STATE_FILE,
    Trainer,
    capture_rng_state,
    restore_rng_state,
)

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
USER_DIR = "user"
RUNTIME_FILE = "runtime.pt"
PACK_FILE = "pack.pt"


def detached_copy(obj: Any) -> Any:
    """A deep copy of ``obj`` whose tensors are fresh CPU tensors sharing nothing with the original."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        return t.clone() if t.device.type == "cpu" else t.to("cpu", copy=True)
    if isinstance(obj, Mapping):
        items = [(k, detached_copy(v)) for k, v in obj.items()]
        out: dict[Any, Any] = OrderedDict(items) if isinstance(obj, OrderedDict) else dict(items)
        metadata = getattr(obj, "_metadata", None)  # nn.Module.state_dict versions its entries
        if metadata is not None:
            out._metadata = copy.deepcopy(metadata)  # type: ignore[attr-defined]
        return out
    if isinstance(obj, list):
        return [detached_copy(v) for v in obj]
    if isinstance(obj, tuple):
        vals = [detached_copy(v) for v in obj]
        return type(obj)(*vals) if hasattr(obj, "_fields") else tuple(vals)
    if obj is None or isinstance(obj, int | float | str | bool | bytes):
        return obj
    return copy.deepcopy(obj)


def runtime_state(point: Point, rng_ranks: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The runtime's part of a checkpoint; ``rng_ranks``: every rank's RNG state, by rank (this
    process's is captured when it is None)."""
    state: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "node": point.node,
        "step": point.step,
        "rng": capture_rng_state() if rng_ranks is None else rng_ranks[0],
    }
    if rng_ranks is not None and len(rng_ranks) > 1:
        state["rng_ranks"] = list(rng_ranks)
    return state


@dataclass(frozen=True)
class Snapshot:
    """A trainer's checkpoint held in memory, safe to write from another thread."""

    user: dict[str, Any]
    runtime: dict[str, Any]

    def write(self, directory: Path) -> None:
        (directory / USER_DIR).mkdir()
        torch.save(self.user, directory / USER_DIR / USER_STATE_FILE)
        torch.save(self.runtime, directory / RUNTIME_FILE)


def pack_key(point: Point) -> str:
    return f"{point.node}:{point.step}"


def snapshot_bytes(snapshot: Snapshot) -> int:
    """The bytes of a snapshot's tensors (what holding it costs; its small Python objects aside)."""
    total = 0
    todo: list[Any] = [snapshot.user, snapshot.runtime]
    while todo:
        obj = todo.pop()
        if isinstance(obj, torch.Tensor):
            total += obj.numel() * obj.element_size()
        elif isinstance(obj, Mapping):
            todo.extend(obj.values())
        elif isinstance(obj, list | tuple):
            todo.extend(obj)
    return total


def write_pack(snapshots: Mapping[Point, Snapshot], directory: Path) -> None:
    """The snapshots of many points as one pack (see the module doc)."""
    points = {pack_key(p): {"user": s.user, "runtime": s.runtime} for p, s in snapshots.items()}
    torch.save({"format": FORMAT_VERSION, "points": points}, directory / PACK_FILE)


def take_snapshot(trainer: Trainer, point: Point, rng_ranks: list[dict[str, Any]] | None = None) -> Snapshot:
    """Only for trainers whose class ``snapshots_in_memory()``."""
    return Snapshot(user=detached_copy(trainer.state_dict()), runtime=detached_copy(runtime_state(point, rng_ranks)))


def save_now(trainer: Trainer, point: Point, directory: Path, rng_ranks: list[dict[str, Any]] | None = None) -> None:
    """Write the trainer's checkpoint into ``directory`` synchronously (the user's ``save``)."""
    user = directory / USER_DIR
    user.mkdir()
    trainer.save(user)
    torch.save(runtime_state(point, rng_ranks), directory / RUNTIME_FILE)


class Restored(NamedTuple):
    """What a restore read: the checkpoint's point and how many ranks wrote it."""

    point: Point
    ranks: int


def restore(trainer: Trainer, store: CheckpointStore, uri: str, rank: int = 0, world_size: int = 1) -> Point:
    """``restore_checkpoint``'s point."""
    return restore_checkpoint(trainer, store, uri, rank, world_size).point


def restore_checkpoint(
    trainer: Trainer,
    store: CheckpointStore,
    uri: str,
    rank: int = 0,
    world_size: int = 1,
    point: Point | None = None,
) -> Restored:
    """Load the checkpoint at ``uri`` into an ``init``-ed trainer and the process RNGs (rank ``rank`` of
    ``world_size``'s own, see the module doc); its point and the number of ranks that wrote it (the
    caller reports a resume on another number, which the master records as the plan's path change).
    A pack gives up the snapshot of ``point`` (the batch's source)."""
    with store.open(uri) as directory:
        if (directory / PACK_FILE).exists():
            return _restore_from_pack(trainer, directory / PACK_FILE, uri, point, world_size)
        rt = torch.load(directory / RUNTIME_FILE, weights_only=True)
        if rt.get("format") != FORMAT_VERSION:
            raise FailedPrecondition(
                f"checkpoint {uri} has format {rt.get('format')!r}, this runtime reads {FORMAT_VERSION}"
            )
        ranks = rt.get("rng_ranks")
        saved = len(ranks) if ranks else 1
        if saved != world_size and not type(trainer).rescalable:
            raise FailedPrecondition(
                f"checkpoint {uri} was written by {saved} rank(s) and this batch runs on {world_size}: "
                f"{type(trainer).__name__} does not say it may resume on another number of ranks (set "
                "rescalable = True on the class if its state does not depend on the number of ranks)"
            )
        trainer.load(directory / USER_DIR)
    if saved == world_size:
        restore_rng_state(ranks[rank] if ranks else rt["rng"])
    else:
        log.warning(
            "resuming a checkpoint of %d rank(s) on %d: each rank continues from rank 0's random streams",
            saved,
            world_size,
            extra={"uri": uri},
        )
        restore_rng_state(rt["rng"])
    return Restored(Point(int(rt["node"]), int(rt["step"])), saved)


def _restore_from_pack(trainer: Trainer, path: Path, uri: str, point: Point | None, world_size: int) -> Restored:
    if point is None:
        raise FailedPrecondition(f"checkpoint {uri} is a pack of snapshots: say which point to restore")
    if world_size != 1 and not type(trainer).rescalable:
        raise FailedPrecondition(
            f"checkpoint {uri} was written by 1 rank and this batch runs on {world_size}: "
            f"{type(trainer).__name__} does not say it may resume on another number of ranks"
        )
    pack = torch.load(path, weights_only=True)
    if pack.get("format") != FORMAT_VERSION:
        raise FailedPrecondition(
            f"checkpoint {uri} has format {pack.get('format')!r}, this runtime reads {FORMAT_VERSION}"
        )
    entry = pack["points"].get(pack_key(point))
    if entry is None:
        raise FailedPrecondition(f"checkpoint {uri} holds no snapshot of node {point.node} at step {point.step}")
    trainer.load_state_dict(entry["user"])
    rt = entry["runtime"]
    restore_rng_state(rt["rng"])
    return Restored(Point(int(rt["node"]), int(rt["step"])), 1)
