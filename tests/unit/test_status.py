"""The one status table: every error class round-trips through it, a master bug is never retried, and no
other table exists in ``services/``."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc.aio import AioRpcError, Metadata

from stagetree.core import errors as e
from stagetree.nodemanager.link import translate
from stagetree.status import INTERNAL, TABLE, error_class_of, status_of
from tests.status_tables import count_status_tables

SERVICES = Path(__file__).resolve().parents[2] / "services"


@pytest.mark.parametrize("cls", [c for c in e.ALL_ERRORS if c is not e.StagetreeError and c is not e.SequenceError])
def test_every_error_class_round_trips(cls: type[e.StagetreeError]) -> None:
    assert error_class_of(status_of(cls.__new__(cls)).grpc) is cls


def test_a_subclass_answers_as_its_parent_and_a_foreign_exception_is_internal() -> None:
    assert status_of(e.SequenceError("f", "g", "m")) == TABLE[e.InvalidArgument]
    assert status_of(ValueError("x")) == INTERNAL


@pytest.mark.parametrize("code", list(grpc.StatusCode))
def test_every_status_code_has_a_defined_meaning(code: grpc.StatusCode) -> None:
    cls = error_class_of(code)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        assert cls is e.Unavailable
    elif code is grpc.StatusCode.ABORTED:
        assert cls is e.Conflict
    elif code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.OK):
        assert cls is None


@pytest.mark.parametrize("code", [grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS])
def test_the_node_manager_link_does_not_retry_a_master_bug(code: grpc.StatusCode) -> None:
    err = translate(AioRpcError(code, Metadata(), Metadata(), "boom"), "h:1", "report")
    assert not err.retriable and "bug in the master" in err.message


def test_the_link_retries_what_a_retry_can_fix() -> None:
    for code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED, grpc.StatusCode.DEADLINE_EXCEEDED):
        assert translate(AioRpcError(code, Metadata(), Metadata(), "x"), "h:1", "report").retriable, code


def test_there_is_one_status_table() -> None:
    assert count_status_tables(SERVICES) == 1
