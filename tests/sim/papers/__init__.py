"""The four scheduling papers' workloads, as workloads of ``core.simulator`` (``tests.bench.policies``)."""

from __future__ import annotations

import functools

from stagetree.core.config import Config


@functools.cache
def index_of(config: Config, name: str) -> int:
    """The integer a paper's trial config carries under ``name`` (which trial, job or task it is):
    every simulated step asks, so it is read once per config."""
    return int(config.values_at(0)[name])
