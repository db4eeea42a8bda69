"""The SDK rides out a master restart: once the master has answered, an idempotent call keeps retrying
``Unavailable`` past ``retries`` (bounded by ``reconnect_s``); a master that never answered fails fast."""

from __future__ import annotations

import grpc
import pytest

from stagetree.client.sdk import Study
from stagetree.core import errors as e
from stagetree.core.config import Config
from tests.unit.client.fakes import FakeMaster, FakeRpcError, fake_client


def _down(master: FakeMaster, method: str, times: int) -> None:
    master.errors[method].extend(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "restarting") for _ in range(times))


async def test_a_master_that_answered_before_is_waited_for_past_the_retry_count() -> None:
    master = FakeMaster()
    client = fake_client(master, retries=2, reconnect_s=30)
    study = await Study.create(client, "s", trainer="pkg.mod:Net", dataset="d", tuned=["lr"])
    _down(master, "SubmitRequests", 4)  # twice the retry count: a restart, not a wrong address
    assert await study.eval({"lr": 0.03}, 3) == master.metrics_of(Config.of({"lr": 0.03}), 3)
    assert len(master.calls["SubmitRequests"]) == 5  # four refused, the fifth answered


async def test_the_wait_is_bounded_by_reconnect_s() -> None:
    master = FakeMaster()
    client = fake_client(master, retries=2, reconnect_s=0.2)
    study = await Study.create(client, "s", trainer="pkg.mod:Net", dataset="d", tuned=["lr"])
    _down(master, "SubmitRequests", 50)
    with pytest.raises(e.Unavailable):
        await study.eval({"lr": 0.03}, 3)


async def test_a_master_that_never_answered_fails_after_the_retries() -> None:
    master = FakeMaster()
    client = fake_client(master, retries=2, reconnect_s=30)
    _down(master, "GetStudy", 3)
    with pytest.raises(e.Unavailable):
        await Study.load(client, "study-1")
    assert len(master.calls["GetStudy"]) == 2  # the retry count, then the error


async def test_a_call_no_connection_carried_is_sent_again_even_when_not_idempotent() -> None:
    """``never_sent``: UNAVAILABLE "failed to connect" (the master's handshake timed out on a loaded host)
    means the master never got the call, so a study's creation is retried; an UNAVAILABLE that may have
    reached it is not."""
    master = FakeMaster()
    client = fake_client(master, retries=3, reconnect_s=30)
    unreached = "failed to connect to all addresses; last error: connection attempt timed out before SETTINGS"
    master.errors["CreateStudy"].extend(FakeRpcError(grpc.StatusCode.UNAVAILABLE, unreached) for _ in range(2))
    study = await Study.create(client, "s", trainer="pkg.mod:Net", dataset="d", tuned=["lr"])
    assert study.name == "s" and len(master.calls["CreateStudy"]) == 3
    master.errors["CreateStudy"].append(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "Socket closed"))
    with pytest.raises(e.Unavailable):
        await Study.create(client, "t", trainer="pkg.mod:Net", dataset="d", tuned=["lr"])
    assert len(master.calls["CreateStudy"]) == 4  # once: it may have been done
