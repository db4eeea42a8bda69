"""The worker runtime: what runs a stage batch inside a worker process.

``Trainer`` (the user's training logic), ``ResumableLoader`` (deterministic, resumable minibatches),
``CheckpointStore`` / ``LocalCheckpointStore`` (where checkpoints live), ``BatchRun`` / ``run_batch``
(the training loop and its events) and ``worker`` (the process entry point). Needs torch.
"""

from stagetree.nodemanager.runtime.checkpoints import CheckpointStore, LocalCheckpointStore, StoredCheckpoint
from stagetree.nodemanager.runtime.dataloader import ResumableLoader
from stagetree.nodemanager.runtime.events import EVENT_FIELDS, decode_event, encode_event
from stagetree.nodemanager.runtime.executor import BatchOutcome, BatchRun, run_batch
from stagetree.nodemanager.runtime.trainer import Trainer, TrainerContext

__all__ = [
    "EVENT_FIELDS",
    "BatchOutcome",
    "BatchRun",
    "CheckpointStore",
    "LocalCheckpointStore",
    "ResumableLoader",
    "StoredCheckpoint",
    "Trainer",
    "TrainerContext",
    "decode_event",
    "encode_event",
    "run_batch",
]
