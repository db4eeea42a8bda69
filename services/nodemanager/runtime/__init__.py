"""The worker runtime: what runs a stage batch inside a worker process.

``Trainer`` (the user's training logic), ``ResumableLoader`` (deterministic, resumable minibatches),
``CheckpointStore`` / ``LocalCheckpointStore`` (where checkpoints live), ``BatchRun`` / ``run_batch``
(the training loop and its events) and ``worker`` (the process entry point). Needs torch.

The names below are imported lazily (PEP 562): the node manager reads ``events`` and deletes through
``checkpoints`` without importing torch, which only its worker processes need.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stagetree.nodemanager.runtime.checkpoints import CheckpointStore, LocalCheckpointStore, StoredCheckpoint
    from stagetree.nodemanager.runtime.dataloader import ResumableLoader
    from stagetree.nodemanager.runtime.events import EVENT_FIELDS, decode_event, encode_event
    from stagetree.nodemanager.runtime.executor import BatchOutcome, BatchRun, run_batch
    from stagetree.nodemanager.runtime.torch_trainer import TorchTrainer
    from stagetree.nodemanager.runtime.trainer import Trainer, TrainerContext

_WHERE = {
    "CheckpointStore": "checkpoints",
    "LocalCheckpointStore": "checkpoints",
    "StoredCheckpoint": "checkpoints",
    "ResumableLoader": "dataloader",
    "EVENT_FIELDS": "events",
    "decode_event": "events",
    "encode_event": "events",
    "BatchOutcome": "executor",
    "BatchRun": "executor",
    "run_batch": "executor",
    "Trainer": "trainer",
    "TorchTrainer": "torch_trainer",
    "TrainerContext": "trainer",
}

__all__ = [
    "EVENT_FIELDS",
    "BatchOutcome",
    "BatchRun",
    "CheckpointStore",
    "LocalCheckpointStore",
    "ResumableLoader",
    "StoredCheckpoint",
    "TorchTrainer",
    "Trainer",
    "TrainerContext",
    "decode_event",
    "encode_event",
    "run_batch",
]


def forked_worker_main(*args: Any) -> None:
    """The target a node manager hands its fork server for each worker (``worker.run_forked``): named by
    this torch-free module, so the node manager's own process never imports the worker runtime."""
    from stagetree.nodemanager.runtime.worker import run_forked

    run_forked(*args)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
