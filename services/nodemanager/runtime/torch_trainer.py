"""``TorchTrainer``: a ``Trainer`` for the common PyTorch case, built from three factories.

A user names a model, an optimizer and the data; this class owns the rest of the ``Trainer`` contract:
the training step (``minibatches`` batches through a ``ResumableLoader``), the evaluation (loss, and
accuracy for class labels), the checkpointed state (model, optimizer, loader: background checkpoints
and exact resume come with it) and the hyper-parameters it applies by itself:

    lr, momentum, weight_decay, beta1, beta2   every param group of the optimizer
    batch_size (or bs)                         the loader, from the next batch on

(``betas`` is a pair, and a sequence's value is one number, so Adam's betas are tuned as ``beta1`` and
``beta2``.) Any other tuned name goes to ``apply_hp``, which fails by default naming the known ones.

On a batch of several ranks it trains data-parallel: the model is wrapped in ``DistributedDataParallel``
(which averages the gradients), every rank draws the same global minibatch (``batch_size`` is the global
size) and trains on its rank-strided rows ``rank::world_size``; each rank's loss is weighted by its
share of the rows, so the averaged gradient is the global minibatch's mean gradient also when the rows
do not divide evenly. The step loss each rank returns is its weighted share, so the runtime's average
over the ranks is the global minibatch's. ``self.model`` stays the plain module: evaluation and
checkpoints use it, so a checkpoint reads the same whatever the number of ranks (``rescalable``). class
Digits(stagetree.TorchTrainer): def make_model(self): return nn.Sequential(nn.Linear(64, 64), nn.ReLU(),
nn.Linear(64, 10)) def make_optimizer(self, params): return torch.optim.SGD(params, lr=0.1) def
make_data(self): return (x_train, y_train), (x_test, y_test)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, TypeAlias

import torch
import torch.nn.functional as F
from torch import nn

from stagetree.core.errors import InvalidArgument
from stagetree.core.sequences import Value
from stagetree.nodemanager.runtime.dataloader import ResumableLoader
from stagetree.nodemanager.runtime.distributed import data_parallel
from stagetree.nodemanager.runtime.trainer import Trainer

Tensors: TypeAlias = tuple[torch.Tensor, ...]

# hyper-parameter name -> the optimizer param-group key it sets
GROUP_HPS: Mapping[str, str] = {"lr": "lr", "momentum": "momentum", "weight_decay": "weight_decay"}
BETA_HPS: Mapping[str, int] = {"beta1": 0, "beta2": 1}
BATCH_SIZE_HPS = ("batch_size", "bs")
KNOWN_HPS = (*GROUP_HPS, *BETA_HPS, *BATCH_SIZE_HPS)


def _tensors(owner: str, data: Any) -> Tensors:
    """``(inputs..., targets)`` from a tuple/list of tensors or a ``TensorDataset``."""
    if isinstance(data, torch.utils.data.TensorDataset):
        data = data.tensors
    if not isinstance(data, tuple | list) or len(data) < 2 or not all(isinstance(t, torch.Tensor) for t in data):
        raise InvalidArgument(
            f"{owner}: make_data must return (train, eval), each a tuple (inputs..., targets) of tensors or a "
            f"TensorDataset; got {type(data).__name__}"
        )
    return tuple(data)


class TorchTrainer(Trainer):
    """Subclass it and implement ``make_model``, ``make_optimizer`` and ``make_data`` (see the module doc).

    Fixed values it reads: ``minibatches`` (batches per step, default ``minibatches``) and ``batch_size``
    (the loader's size until a tuned one applies, default ``batch_size``).
    """

    minibatches: ClassVar[int] = 1
    batch_size: ClassVar[int] = 32
    prepare_ahead = True  # init only builds (model, optimizer, data)
    # ``make_data``'s tensors, on the device, are kept by a warm worker for the next batches of the same
    # fixed part (``Trainer.cached``): set False when make_data reads what may change between batches
    # (a file still being written) or depends on more than the fixed values, seed, rank and device
    keep_data: ClassVar[bool] = True
    rescalable = True  # model, optimizer and loader state do not depend on the number of ranks

    model: nn.Module
    train_model: nn.Module  # the model as trained: ``model`` wrapped for data parallelism on several ranks
    optimizer: torch.optim.Optimizer
    loader: ResumableLoader
    eval_data: Tensors
    hp: dict[str, Value]

    # -- the factories ---------------------------------------------------------------------------

    def make_model(self) -> nn.Module:
        raise NotImplementedError(f"{type(self).__name__}: implement make_model()")

    def make_optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        """The optimizer over ``params``; tuned hyper-parameters overwrite its initial values."""
        raise NotImplementedError(f"{type(self).__name__}: implement make_optimizer(params)")

    def make_data(self) -> tuple[Any, Any]:
        """``(train, eval)``: each ``(inputs..., targets)`` as tensors, or a ``TensorDataset``."""
        raise NotImplementedError(f"{type(self).__name__}: implement make_data()")

    # -- overridable pieces ----------------------------------------------------------------------

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Cross-entropy by default."""
        return F.cross_entropy(output, target)

    def apply_hp(self, name: str, value: Value) -> None:
        """A tuned hyper-parameter this class does not apply itself (its value is in ``self.hp`` too)."""
        raise InvalidArgument(
            f"{type(self).__name__}: hyper-parameter {name!r} is not one TorchTrainer applies ({list(KNOWN_HPS)}); "
            "override apply_hp(name, value) to use it"
        )

    # -- the Trainer contract --------------------------------------------------------------------

    def init(self) -> None:
        name = type(self).__name__
        self.model = self.make_model().to(self.device)
        self.train_model = data_parallel(self.model, self.device, self.world_size)
        self.optimizer = self.make_optimizer(self.model.parameters())
        train_t, self.eval_data = self.cached("data", self._data) if self.keep_data else self._data()
        self.steps_per_call = int(self.fixed.get("minibatches", self.minibatches))
        if self.steps_per_call < 1:
            raise InvalidArgument(f"{name}: minibatches must be at least 1, got {self.steps_per_call}")
        bs = int(self.fixed.get("batch_size", self.batch_size))
        self.loader = ResumableLoader(*train_t, batch_size=bs, seed=self.seed)
        self.hp = {}

    def setup(self, hp_changes: dict[str, Value]) -> None:
        self.hp.update(hp_changes)
        for name, value in hp_changes.items():
            if name in GROUP_HPS:
                self._set_group(GROUP_HPS[name], name, float(value))
            elif name in BETA_HPS:
                self._set_beta(name, float(value))
            elif name in BATCH_SIZE_HPS:
                self.loader.set_batch_size(int(value))
            else:
                self.apply_hp(name, value)

    def train(self) -> dict[str, torch.Tensor]:
        """The step's minibatches; its mean loss stays a tensor on the device: converting it is a host-device
        sync, which the runtime makes only for the curve points it keeps (on a GPU a sync per minibatch
        stops the host from queueing the next one while the last runs)."""
        model = self.train_model
        model.train()
        world, rank = self.world_size, self.rank
        total: torch.Tensor | None = None
        for _ in range(self.steps_per_call):
            *inputs, target = next(self.loader)
            self.optimizer.zero_grad(set_to_none=True)
            if world > 1:
                rows = int(target.shape[0])
                *inputs, target = (t[rank::world] for t in (*inputs, target))
                # DDP averages over ranks: weighting by the rank's share makes it the global mean
                weight = int(target.shape[0]) * world / rows
                loss = self.loss(model(*inputs), target) * weight
            else:
                loss = self.loss(model(*inputs), target)
            loss.backward()  # type: ignore[no-untyped-call]
            self.optimizer.step()
            total = loss.detach() if total is None else total + loss.detach()
        assert total is not None  # steps_per_call >= 1
        return {"loss": total / self.steps_per_call}

    def evaluate(self) -> dict[str, float]:
        *inputs, target = self.eval_data
        self.model.eval()
        with torch.no_grad():
            output = self.model(*inputs)
            out = {"loss": float(self.loss(output, target))}
            if output.dim() == 2 and target.dim() == 1 and not target.is_floating_point():
                out["accuracy"] = float((output.argmax(dim=1) == target).float().mean())
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "loader": self.loader.state_dict(),
            "hp": dict(self.hp),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.loader.load_state_dict(state["loader"])
        self.hp = dict(state.get("hp", {}))

    # -- helpers ---------------------------------------------------------------------------------

    def _data(self) -> tuple[Tensors, Tensors]:
        name = type(self).__name__
        train, evaluation = self.make_data()
        train_t = tuple(t.to(self.device) for t in _tensors(name, train))
        return train_t, tuple(t.to(self.device) for t in _tensors(name, evaluation))

    def _set_group(self, key: str, name: str, value: float) -> None:
        for group in self.optimizer.param_groups:
            if key not in group:
                raise InvalidArgument(
                    f"{type(self).__name__}: hyper-parameter {name!r}: {type(self.optimizer).__name__} has no "
                    f"{key!r} (its param groups have {sorted(k for k in group if k != 'params')})"
                )
            group[key] = value

    def _set_beta(self, name: str, value: float) -> None:
        for group in self.optimizer.param_groups:
            betas = group.get("betas")
            if not isinstance(betas, tuple | list) or len(betas) != 2:
                raise InvalidArgument(
                    f"{type(self).__name__}: hyper-parameter {name!r}: {type(self.optimizer).__name__} has no betas"
                )
            pair = list(betas)
            pair[BETA_HPS[name]] = value
            group["betas"] = (pair[0], pair[1])
