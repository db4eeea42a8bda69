"""Small helpers shared by the master's integration tests."""

from __future__ import annotations

import json
import uuid
from typing import Any


def unique(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def fixed(trainer: str | None = None, seed: int = 0) -> dict[str, Any]:
    trainer = trainer or f"pkg_{uuid.uuid4().hex[:10]}.train:Net"  # a plan of its own
    return {"trainer": trainer, "dataset": "mnist", "model": "mlp", "seed": seed, "values": {}}


def config_json(fixed_part: dict[str, Any], lr: Any = 0.1, bs: Any = 32) -> str:
    return json.dumps({"fixed": fixed_part, "tuned": {"lr": lr, "bs": bs}})


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)
