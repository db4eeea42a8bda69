"""The tuner registry: a typed mapping from tuner name to factory.

This module owns ``TUNERS`` and ``make_tuner(name, **kwargs)``; an unknown name is an ``InvalidArgument``
that lists the known names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, TypeAlias

from stagetree.client.tuners.asha import ASHA
from stagetree.client.tuners.base import Tuner
from stagetree.client.tuners.basic import GridTuner, RandomTuner
from stagetree.client.tuners.early_stop import EarlyStopTuner
from stagetree.client.tuners.halving import SHA, Hyperband
from stagetree.client.tuners.median import MedianStopping
from stagetree.client.tuners.pbt import PBT
from stagetree.core.errors import InvalidArgument

TunerFactory: TypeAlias = Callable[..., Tuner]

TUNERS: Mapping[str, TunerFactory] = MappingProxyType(
    {
        "grid": GridTuner,
        "random": RandomTuner,
        "sha": SHA,
        "asha": ASHA,
        "hyperband": Hyperband,
        "median": MedianStopping,
        "pbt": PBT,
        "early_stop": EarlyStopTuner,
    }
)


def tuner_factory(name: str) -> TunerFactory:
    factory = TUNERS.get(name) if isinstance(name, str) else None
    if factory is None:
        raise InvalidArgument(f"unknown tuner {name!r}; known tuners: {sorted(TUNERS)}")
    return factory


def make_tuner(name: str, /, *args: Any, **kwargs: Any) -> Tuner:
    """``make_tuner("asha", space, metric="acc", max_step=27, max_concurrent=4)``."""
    return tuner_factory(name)(*args, **kwargs)
