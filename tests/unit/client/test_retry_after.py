"""The SDK reads the master's retry-after from a shed call (RESOURCE_EXHAUSTED with ``retry-after-ms``,
``stagetree.master.api.admission``) and nothing else: a RESOURCE_EXHAUSTED without it (a batch over the
item limit) is an error to report, not to retry."""

from __future__ import annotations

import grpc
from grpc.aio import AioRpcError, Metadata

from stagetree.client.sdk import retry_after_s
from stagetree.master.api.admission import RETRY_AFTER_MD, Admission


def _err(code: grpc.StatusCode, *trailers: tuple[str, str]) -> AioRpcError:
    return AioRpcError(code, Metadata(), Metadata(*trailers), "x")


def test_a_shed_call_says_when_to_come_back() -> None:
    assert retry_after_s(_err(grpc.StatusCode.RESOURCE_EXHAUSTED, (RETRY_AFTER_MD, "250"))) == 0.25
    assert retry_after_s(_err(grpc.StatusCode.RESOURCE_EXHAUSTED, (RETRY_AFTER_MD, "999999"))) == 60.0  # capped
    assert retry_after_s(_err(grpc.StatusCode.RESOURCE_EXHAUSTED, (RETRY_AFTER_MD, "soon"))) is None
    assert retry_after_s(_err(grpc.StatusCode.RESOURCE_EXHAUSTED)) is None  # over a limit: not a retry
    assert retry_after_s(_err(grpc.StatusCode.UNAVAILABLE, (RETRY_AFTER_MD, "250"))) is None


def test_admission_counts_what_it_admits_and_sheds() -> None:
    a = Admission(2, 0.5)
    assert a.try_enter() and a.try_enter() and not a.try_enter()
    assert (a.in_flight, a.refused, a.peak) == (2, 1, 2)
    a.leave()
    assert a.try_enter() and a.peak == 2
    assert "MAX_IN_FLIGHT" in a.message() and "0.5 s" in a.message()
