"""stagetree: hyper-parameter optimization that shares the training of common schedule prefixes.

The public SDK, re-exported here::

    import stagetree
    from stagetree import Constant, MultiStep, GridSearchSpace, ASHA

    async with stagetree.connect("127.0.0.1:50051", token="...") as client:
        study = await stagetree.Study.create(client, "sweep", trainer="pkg.train:Net", tuned=["lr"])
        metrics = await study.eval({"lr": MultiStep(0.1, [30], 0.1)}, step=40)
        run = await stagetree.drive(study, ASHA(space, metric="acc", max_step=27, max_concurrent=8))

Every name is imported on first use (``__getattr__``), so ``import stagetree`` (and every
``import stagetree.<service>``, which runs this file first) stays cheap: no gRPC until the SDK is used,
and no torch until ``stagetree.Trainer`` (or ``TorchTrainer``, ``ResumableLoader``) is: a user's
trainer module needs only ``import stagetree``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # SDK
    "connect": "stagetree.client.sdk",
    "Client": "stagetree.client.sdk",
    "Study": "stagetree.client.sdk",
    "StudyInfo": "stagetree.client.sdk",
    "Evaluation": "stagetree.client.sdk",
    "EvalResult": "stagetree.client.sdk",
    "EvalFailed": "stagetree.client.sdk",
    "EvalCancelled": "stagetree.client.sdk",
    "ClientTls": "stagetree.tls",
    "drive": "stagetree.client.driver",
    "tune": "stagetree.client.tune",
    "TuneResult": "stagetree.client.tune",
    # search spaces
    "GridSearchSpace": "stagetree.client.spaces",
    "RandomSearchSpace": "stagetree.client.spaces",
    "Choice": "stagetree.client.spaces",
    "Uniform": "stagetree.client.spaces",
    "LogUniform": "stagetree.client.spaces",
    "IntUniform": "stagetree.client.spaces",
    "Family": "stagetree.client.spaces",
    "Shared": "stagetree.client.spaces",
    # tuners
    "Tuner": "stagetree.client.tuners",
    "GridTuner": "stagetree.client.tuners",
    "RandomTuner": "stagetree.client.tuners",
    "SHA": "stagetree.client.tuners",
    "ASHA": "stagetree.client.tuners",
    "Hyperband": "stagetree.client.tuners",
    "MedianStopping": "stagetree.client.tuners",
    "PBT": "stagetree.client.tuners",
    "EarlyStopTuner": "stagetree.client.tuners",
    "make_tuner": "stagetree.client.tuners",
    # sequence families
    "Sequence": "stagetree.core.sequences",
    "Constant": "stagetree.core.sequences",
    "Linear": "stagetree.core.sequences",
    "Exponential": "stagetree.core.sequences",
    "Step": "stagetree.core.sequences",
    "MultiStep": "stagetree.core.sequences",
    "Cosine": "stagetree.core.sequences",
    "CyclicLR": "stagetree.core.sequences",
    "Warmup": "stagetree.core.sequences",
    "Piecewise": "stagetree.core.sequences",
    # errors
    "StagetreeError": "stagetree.core.errors",
    "InvalidArgument": "stagetree.core.errors",
    "SequenceError": "stagetree.core.errors",
    "NotFound": "stagetree.core.errors",
    "AlreadyExists": "stagetree.core.errors",
    "Unauthenticated": "stagetree.core.errors",
    "PermissionDenied": "stagetree.core.errors",
    "FailedPrecondition": "stagetree.core.errors",
    "ResourceExhausted": "stagetree.core.errors",
    "Conflict": "stagetree.core.errors",
    "Unavailable": "stagetree.core.errors",
    # the user's training logic (imports torch)
    "Trainer": "stagetree.nodemanager.runtime.trainer",
    "TorchTrainer": "stagetree.nodemanager.runtime.torch_trainer",
    "ResumableLoader": "stagetree.nodemanager.runtime.dataloader",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'stagetree' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:
    from stagetree.client.driver import drive
    from stagetree.client.sdk import (
        Client,
        EvalCancelled,
        EvalFailed,
        EvalResult,
        Evaluation,
        Study,
        StudyInfo,
        connect,
    )
    from stagetree.client.spaces import (
        Choice,
        Family,
        GridSearchSpace,
        IntUniform,
        LogUniform,
        RandomSearchSpace,
        Shared,
        Uniform,
    )
    from stagetree.client.tune import TuneResult, tune
    from stagetree.client.tuners import (
        ASHA,
        PBT,
        SHA,
        EarlyStopTuner,
        GridTuner,
        Hyperband,
        MedianStopping,
        RandomTuner,
        Tuner,
        make_tuner,
    )
    from stagetree.core.errors import (
        AlreadyExists,
        Conflict,
        FailedPrecondition,
        InvalidArgument,
        NotFound,
        PermissionDenied,
        ResourceExhausted,
        SequenceError,
        StagetreeError,
        Unauthenticated,
        Unavailable,
    )
    from stagetree.core.sequences import (
        Constant,
        Cosine,
        CyclicLR,
        Exponential,
        Linear,
        MultiStep,
        Piecewise,
        Sequence,
        Step,
        Warmup,
    )
    from stagetree.nodemanager.runtime.dataloader import ResumableLoader
    from stagetree.nodemanager.runtime.torch_trainer import TorchTrainer
    from stagetree.nodemanager.runtime.trainer import Trainer
    from stagetree.tls import ClientTls
