"""Fixtures of the worker-runtime tests: a checkpoint store in a temp dir, and event recorders that
check every event against the published field lists as it is emitted."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from stagetree.nodemanager.runtime.checkpoints import LocalCheckpointStore
from stagetree.nodemanager.runtime.events import CHECKPOINT_KINDS, EVENT_FIELDS


class Events:
    """An ``emit`` that records events, failing on any that breaks the event contract."""

    def __init__(self, on_emit: Callable[[str, dict[str, Any]], None] | None = None) -> None:
        self.items: list[tuple[str, dict[str, Any]]] = []
        self._on_emit = on_emit

    def __call__(self, kind: str, payload: dict[str, Any]) -> None:
        assert kind in EVENT_FIELDS, kind
        assert set(payload) == EVENT_FIELDS[kind], (kind, payload)
        json.dumps(payload)  # must travel as JSON
        if kind == "checkpoint_saved":
            assert payload["kind"] in CHECKPOINT_KINDS
        self.items.append((kind, payload))
        if self._on_emit is not None:
            self._on_emit(kind, payload)

    def kinds(self) -> list[str]:
        return [k for k, _ in self.items]

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [p for k, p in self.items if k == kind]

    def metrics_at(self, step: int) -> dict[str, float]:
        found = [p["metrics"] for p in self.of("metrics") if p["step"] == step]
        assert found, f"no metrics at step {step}: {self.kinds()}"
        return dict(found[0])

    def checkpoint_at(self, step: int) -> dict[str, Any]:
        found = [p for p in self.of("checkpoint_saved") if p["step"] == step]
        assert found, f"no checkpoint at step {step}: {self.of('checkpoint_saved')}"
        return found[0]


@pytest.fixture
def make_events() -> type[Events]:
    return Events


@pytest.fixture
def store(tmp_path: Path) -> LocalCheckpointStore:
    return LocalCheckpointStore(tmp_path / "ckpt", fsync=False)


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Workers run with one thread; so do these tests (tiny ops on a busy machine crawl with more)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
