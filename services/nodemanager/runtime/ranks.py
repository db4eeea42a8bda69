"""Where a worker stands in its batch's group of ranks, without torch: what the node manager hands each
rank (``RankInfo`` in the spec's ``extra["rank"]``, a free rendezvous port) and reads back
(``PEER_LOST_NOTE``). The node manager imports this module, never ``runtime.distributed``, so its own
process does not pay for torch's import (seconds) that only its workers need.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from stagetree.core.errors import InvalidArgument

RANK_KEY = "rank"  # spec.extra[RANK_KEY]: this worker's RankInfo (to_json)
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class RankInfo:
    """One worker's place in its batch's group."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    addr: str = LOOPBACK
    port: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size or not 0 <= self.local_rank < self.world_size:
            raise InvalidArgument(f"rank {self.rank} / local rank {self.local_rank} of a world of {self.world_size}")
        if self.world_size > 1 and not 0 < self.port < 65536:
            raise InvalidArgument(f"a group of {self.world_size} ranks needs a rendezvous port, got {self.port}")

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def leader(self) -> bool:
        """Rank 0: the one that reports and writes checkpoints."""
        return self.rank == 0

    def env(self) -> dict[str, str]:
        """The torch.distributed variables (``init_method="env://"``)."""
        return {
            "MASTER_ADDR": self.addr,
            "MASTER_PORT": str(self.port),
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "local_rank": self.local_rank,
            "addr": self.addr,
            "port": self.port,
        }

    @classmethod
    def from_json(cls, o: Any) -> RankInfo:
        if not isinstance(o, Mapping):
            raise InvalidArgument(f"rank info: expected an object, got {o!r}")
        try:
            return cls(
                int(o["rank"]),
                int(o["world_size"]),
                int(o.get("local_rank", o["rank"])),
                str(o["addr"]),
                int(o["port"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidArgument(f"rank info {o!r}: {e!r}") from None

    @classmethod
    def of_extra(cls, extra: Mapping[str, Any]) -> RankInfo:
        """The rank a spec's ``extra`` gives (rank 0 of 1 when it gives none)."""
        raw = extra.get(RANK_KEY)
        return cls() if raw is None else cls.from_json(raw)


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port free on ``host`` now (the rendezvous of a group started next; the kernel does not
    hand the same ephemeral port out again at once)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# How a rank's failure starts when a collective failed because another rank went away (its group's end
# is that other rank's, not this one: ``nodemanager.group``).
PEER_LOST_NOTE = "a peer rank of this batch went away"
