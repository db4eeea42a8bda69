"""The ``Trainer`` base class users subclass, and the process-wide RNG state the runtime owns.

A trainer is the user's training logic (TreeML §5.1): ``init`` builds model, optimizer and data;
``setup(hp_changes)`` applies the hyper-parameters whose value changes at the coming step (all of
them at the first step of a run or resume); ``train`` runs one logical step and may return its step
metrics (``{"loss": 0.41}``: the learning curve, sampled by the runtime at the batch's curve rate; or
call ``self.log(loss=...)`` during the step); ``evaluate`` returns metrics; ``save``/``load`` persist the
trainer's own state into / from a directory. ``self.log_text(line)`` logs a line of text, kept with the
batch attempt and shown with each request it served (bounded: ``core.loglines``).

A trainer that implements ``state_dict``/``load_state_dict`` (tensors and plain containers) and keeps
the default ``save``/``load`` gets background checkpoints: the runtime snapshots that state in memory
and writes it in a thread while training continues. One that overrides ``save``/``load`` is saved
synchronously.

The runtime, not the user, seeds and checkpoints the RNGs of python ``random``, numpy and torch
(CPU, and CUDA when it is in use), so a resumed run continues the same random streams.

A batch on ``n`` slots runs the trainer in ``n`` processes, one ``torch.distributed`` group (the runtime
has joined it before ``init``): ``self.rank`` and ``self.world_size`` say which share of the data this
process trains on. Every rank is seeded alike and builds the same model; ``train`` runs on every rank,
in step (the ranks' collectives must match), and shards each minibatch by rank; ``evaluate``, ``save``
and ``state_dict`` run on rank 0 only and must not use collectives; ``load`` runs on every rank. The
step metrics ``train`` returns (and ``log``-s) are averaged over the ranks by the runtime (every rank
reports the same names). ``TorchTrainer`` does all of it (DistributedDataParallel, rank-strided rows of
each global minibatch); see docs/trainers.md.
"""

from __future__ import annotations

import importlib
import json
import logging
import random
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch

from stagetree.core.errors import InvalidArgument
from stagetree.core.loglines import MAX_LINES, lines_of
from stagetree.core.sequences import Value
from stagetree.nodemanager.runtime.userpath import user_search_path

log = logging.getLogger(__name__)

USER_STATE_FILE = "trainer.pt"

# What ``train`` may return and ``log`` takes: metric name -> a float or a 0-d tensor
StepMetrics = Mapping[str, "float | torch.Tensor"]
T = TypeVar("T")


@dataclass(frozen=True)
class TrainerContext:
    """What the runtime tells a trainer before ``init``: the fixed part's values, the seed, the device."""

    fixed: Mapping[str, Any] = field(default_factory=dict)
    seed: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    rank: int = 0
    world_size: int = 1


class Trainer(ABC):
    """Base class of a user's training logic; the runtime drives it one step at a time.

    Attributes set by the runtime before ``init``: ``fixed`` (the fixed part's values), ``seed``,
    ``device``, ``rank`` and ``world_size`` (a batch on several slots: see the module doc); and before
    each ``train`` call: ``step`` (the number of steps trained so far).
    """

    fixed: Mapping[str, Any]
    seed: int
    device: torch.device
    rank: int
    world_size: int
    step: int
    # step metrics logged during the current step (``log``); the runtime takes them after ``train``
    logged: dict[str, float | torch.Tensor]
    # text lines logged (``log_text``) as (epoch seconds, line), and how many more did not fit: the runtime
    # takes them after each step (and after ``init`` and each evaluation)
    logged_lines: list[tuple[float, str]]
    lines_dropped: int

    # Whether ``init`` only builds (model, optimizer, data: no side effects outside the process, such as
    # creating an experiment-tracker run) so that a warm worker may run it ahead, before its batch
    # arrives, for the fixed part the slot ran last: a batch of that fixed part then starts from the
    # trainer built ahead, and any other batch builds its own (the one built ahead is dropped).
    prepare_ahead: ClassVar[bool] = False

    # Whether a checkpoint written by a group of n ranks may resume on another number of ranks: the
    # trainer's state is the same on every rank (model, optimizer, data position) and does not depend on
    # n. The run is then valid but not bit-exact (each rank's random streams start from rank 0's).
    rescalable: ClassVar[bool] = False

    def bind(self, ctx: TrainerContext) -> None:
        """Called by the runtime, once, before ``init``."""
        self.fixed = dict(ctx.fixed)
        self.seed = ctx.seed
        self.device = ctx.device
        self.rank = ctx.rank
        self.world_size = ctx.world_size
        self.step = 0
        self.logged = {}
        self.logged_lines, self.lines_dropped = [], 0

    def cached(self, name: str, build: Callable[[], T]) -> T:
        """``build()``, kept by this worker process for the next batches it runs of the same fixed part:
        a warm worker (docs/trainers.md) builds what ``name`` holds once, not once per batch. Use it in
        ``init`` for what depends on nothing but the fixed values, the seed, the rank and the device, and
        what training never changes in place (a data set loaded and moved to the device). The worker
        keeps the values of one fixed part at a time, for as long as it lives.

        ``build`` runs with the random streams it would run with, and the streams after it are those
        before it (its draws are its own): a batch trains the same whether the value was kept or built."""
        key = _cache_key(self)
        if _KEPT.key != key:
            _KEPT.key, _KEPT.values = key, {}
        if name not in _KEPT.values:
            rng = capture_rng_state()
            try:
                _KEPT.values[name] = build()
            finally:
                restore_rng_state(rng)
        return _KEPT.values[name]  # type: ignore[no-any-return]

    def log(self, values: StepMetrics | None = None, /, **more: float | torch.Tensor) -> None:
        """Report step metrics of the step being trained (a learning-curve point at ``self.step + 1``),
        as a mapping or as keywords; merged with what ``train`` returns (``train``'s values win). The
        runtime samples them at the batch's curve rate, so calling it every step is cheap."""
        if values:
            self.logged.update(values)
        if more:
            self.logged.update(more)

    def log_text(self, line: object) -> None:
        """Log a line of text (its ``str``; a text of several lines is that many lines), kept with this
        batch attempt and shown with every request the batch served (REST ``GET .../requests/{id}/logs``).
        Bounded (``core.loglines``): a line keeps its first ``MAX_LINE_CHARS`` characters, an attempt its
        first ``MAX_LINES`` lines (the last of which then says how many more were logged). On a batch of
        several ranks, rank 0's lines are kept."""
        now = time.time()
        for text in lines_of(line):
            if len(self.logged_lines) < MAX_LINES:
                self.logged_lines.append((now, text))
            else:  # the runtime takes them every step: only a step that logs this much gets here
                self.lines_dropped += 1

    @abstractmethod
    def init(self) -> None:
        """Build the model, optimizer and data loaders (the runtime has seeded every RNG)."""

    @abstractmethod
    def setup(self, hp_changes: dict[str, Value]) -> None:
        """Apply the hyper-parameters whose value changes at the coming step."""

    @abstractmethod
    def train(self) -> StepMetrics | None:
        """Run one logical training step; may return its step metrics (``{"loss": 0.41}``, floats or
        0-d tensors), which become a point of the learning curve."""

    @abstractmethod
    def evaluate(self) -> dict[str, float]:
        """Metrics of the model trained so far. Any randomness used here does not leak into training:
        the runtime restores the RNG states after it."""

    def state_dict(self) -> dict[str, Any]:
        """The trainer's whole state (model, optimizer, data loader) as tensors and plain containers.

        Implement it together with ``load_state_dict`` to get background checkpoints, or override
        ``save``/``load`` instead."""
        raise NotImplementedError(f"{type(self).__name__}: implement state_dict/load_state_dict, or override save/load")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError(f"{type(self).__name__}: implement state_dict/load_state_dict, or override save/load")

    def save(self, directory: Path) -> None:
        """Write the trainer's state into ``directory`` (it exists and is empty)."""
        torch.save(self.state_dict(), directory / USER_STATE_FILE)

    def load(self, directory: Path) -> None:
        """Restore the state ``save`` wrote; called after ``init``."""
        self.load_state_dict(torch.load(directory / USER_STATE_FILE, weights_only=True))

    @classmethod
    def snapshots_in_memory(cls) -> bool:
        """Whether the runtime may checkpoint this trainer in the background (see the module doc)."""
        return cls.save is Trainer.save and cls.state_dict is not Trainer.state_dict


@dataclass
class _Kept:
    """What ``Trainer.cached`` keeps in this process: the values of one trainer class and fixed part."""

    key: tuple[Any, ...] | None = None
    values: dict[str, Any] = field(default_factory=dict)


_KEPT = _Kept()


def _cache_key(trainer: Trainer) -> tuple[Any, ...]:
    cls = type(trainer)
    fixed = json.dumps(trainer.fixed, sort_keys=True, default=repr)
    return (
        cls.__module__,
        cls.__qualname__,
        fixed,
        trainer.seed,
        trainer.rank,
        trainer.world_size,
        str(trainer.device),
    )


class EntryPointError(InvalidArgument):
    """The trainer entry point names nothing usable in its module (no such class, not a ``Trainer``): its
    message says it all, the traceback would only show stagetree's frames."""


class TrainerModuleNotFound(ModuleNotFoundError):
    """The entry point's module is not on this host's search path: another host may have it."""


def load_trainer_class(entry_point: str) -> type[Trainer]:
    """The class named by ``"package.module:ClassName"`` (the fixed part's ``trainer``), imported from
    the user's search path first (``user_search_path``). A ``ModuleNotFoundError`` (the module, or one it
    imports, is not installed here) is this host's problem; an ``EntryPointError`` is the entry point's."""
    module_name, sep, attr = entry_point.partition(":")
    if not sep or not module_name or not attr:
        raise EntryPointError(f"trainer entry point {entry_point!r}: expected 'package.module:ClassName'")
    for p in reversed(user_search_path()):
        if p not in sys.path:
            sys.path.insert(0, p)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is None or not module_name.startswith(e.name):
            raise  # the user's module imports something missing: its own traceback says what
        raise TrainerModuleNotFound(
            f"trainer entry point {entry_point!r}: no module named {e.name!r} on the worker's search path "
            f"{[p for p in sys.path if p]}; start the node manager in the module's directory (or put it on "
            "PYTHONPATH, or next to the script that runs stagetree in embedded mode), or install its package "
            "where the node manager runs",
            name=e.name,
        ) from None
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise EntryPointError(
                f"trainer entry point {entry_point!r}: module {module_name} "
                f"({getattr(module, '__file__', None) or 'no file'}) has no {attr!r}{_trainers_of(module)}"
            )
    if not isinstance(obj, type) or not issubclass(obj, Trainer):
        raise EntryPointError(
            f"trainer entry point {entry_point!r} is not a subclass of stagetree Trainer{_trainers_of(module)}"
        )
    return obj


def _trainers_of(module: Any) -> str:
    """``"; its Trainer classes: A, B"`` for the classes a module defines or imports that subclass Trainer."""
    found = sorted(
        name
        for name, v in vars(module).items()
        if isinstance(v, type) and issubclass(v, Trainer) and v is not Trainer and not name.startswith("_")
    )
    return f"; its Trainer classes: {', '.join(found)}" if found else "; it has no Trainer class"


# ---------------------------------------------------------------------------------------------
# RNG state: stored with tensors and ints only, so checkpoints load with ``weights_only=True``.


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    if torch.accelerator.is_available():
        torch.manual_seed(seed)  # every device's generators too (queued until the device initialises)
    else:
        # the CPU's alone: torch.manual_seed queues a seeding for each accelerator torch was built for, a
        # formatted stack each (about 1 ms a batch on a CPU worker)
        torch.default_generator.manual_seed(seed)


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]


def capture_rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": {
            "version": int(version),
            "internal": torch.tensor(internal, dtype=torch.int64),
            "gauss": gauss,
        },
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if _cuda_in_use():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["internal"].tolist()), py["gauss"]))
    npst = state["numpy"]
    np.random.set_state(
        (
            npst["kind"],
            npst["keys"].numpy().astype(np.uint32),
            npst["pos"],
            npst["has_gauss"],
            npst["cached"],
        )
    )
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:
            log.warning(
                "checkpoint holds CUDA RNG states for %d devices, this process sees %d: not restored",
                len(cuda),
                torch.cuda.device_count(),
            )
