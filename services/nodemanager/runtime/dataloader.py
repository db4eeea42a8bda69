"""A resumable, deterministic minibatch loader (TreeML §5.1).

It owns the order in which a dataset is visited: one seeded permutation per epoch drawn from its own
``torch.Generator`` (so nothing else that uses the global RNG shifts it), a cursor into that
permutation, and a batch size that may change between steps. ``state_dict`` holds all of it, so a
run saved after k batches and resumed yields exactly the batches an uninterrupted run would, also
across a batch-size change. A batch never spans two epochs: the last one of an epoch may be smaller
(or is skipped with ``drop_last``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from stagetree.core.errors import InvalidArgument

log = logging.getLogger(__name__)

STATE_VERSION = 1


class ResumableLoader:
    """Yields tuples of rows of ``tensors`` (all with the same first dimension), batch by batch."""

    def __init__(self, *tensors: torch.Tensor, batch_size: int, seed: int, drop_last: bool = False) -> None:
        if not tensors:
            raise InvalidArgument("ResumableLoader needs at least one tensor")
        n = int(tensors[0].shape[0])
        if n == 0 or any(int(t.shape[0]) != n for t in tensors):
            raise InvalidArgument("ResumableLoader: tensors must be non-empty and have the same length")
        self._tensors = tensors
        self._n = n
        self._drop_last = drop_last
        self._generator = torch.Generator()
        self._generator.manual_seed(seed)
        self._perm: torch.Tensor | None = None
        self._cursor = 0
        self._epoch = 0
        self._batch_size = 0
        self.set_batch_size(batch_size)

    def __len__(self) -> int:
        return self._n

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def epoch(self) -> int:
        """Epochs begun so far minus one (0 during the first epoch)."""
        return self._epoch

    @property
    def cursor(self) -> int:
        return self._cursor

    def set_batch_size(self, batch_size: int) -> None:
        """Takes effect at the next batch; the position in the epoch is kept."""
        if isinstance(batch_size, bool) or int(batch_size) != batch_size or batch_size < 1:
            raise InvalidArgument(f"batch size must be a positive int, got {batch_size!r}")
        if self._drop_last and batch_size > self._n:
            raise InvalidArgument(f"batch size {batch_size} exceeds the dataset ({self._n}) with drop_last")
        self._batch_size = int(batch_size)

    def next_indices(self) -> torch.Tensor:
        """The dataset indices of the next batch."""
        bs = self._batch_size
        if self._perm is None:
            self._perm = torch.randperm(self._n, generator=self._generator)
        left = self._n - self._cursor
        if left == 0 or (self._drop_last and left < bs):
            self._epoch += 1
            self._cursor = 0
            self._perm = torch.randperm(self._n, generator=self._generator)
        idx = self._perm[self._cursor : self._cursor + bs]
        self._cursor += int(idx.shape[0])
        return idx

    def __iter__(self) -> ResumableLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, ...]:
        idx = self.next_indices()
        return tuple([t[idx] for t in self._tensors])

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "n": self._n,
            "perm": None if self._perm is None else self._perm.clone(),
            "cursor": self._cursor,
            "epoch": self._epoch,
            "batch_size": self._batch_size,
            "generator": self._generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise InvalidArgument(f"data loader state version {state.get('version')!r}, expected 1")
        if int(state["n"]) != self._n:
            raise InvalidArgument(f"data loader state is for a dataset of {state['n']} rows, this one has {self._n}")
        perm = state["perm"]
        self._perm = None if perm is None else perm.clone()
        self._cursor = int(state["cursor"])
        self._epoch = int(state["epoch"])
        self.set_batch_size(int(state["batch_size"]))
        self._generator.set_state(state["generator"].clone())
