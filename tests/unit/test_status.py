"""The one status table: every error class round-trips through it, every status code means a class, a
master bug is never retried, and no other table exists in ``services/``."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc.aio import AioRpcError, Metadata

from stagetree.core import errors as e
from stagetree.nodemanager.link import translate
from stagetree.status import INTERNAL, SERVER_BUG, TABLE, error_class_of, error_of_code, status_of
from tests.status_tables import count_status_tables, status_tables

SERVICES = Path(__file__).resolve().parents[2] / "services"
RETRIED = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED}


def _instance(cls: type[e.StagetreeError]) -> e.StagetreeError:
    return cls("f", "x", "y") if cls is e.SequenceError else cls("boom")  # type: ignore[call-arg]


@pytest.mark.parametrize("cls", e.ALL_ERRORS)
def test_every_error_class_round_trips(cls: type[e.StagetreeError]) -> None:
    st = status_of(_instance(cls))
    back = error_class_of(st.grpc)
    assert issubclass(cls, back)  # SequenceError answers as InvalidArgument, its nearest row
    assert back is cls or cls not in TABLE
    assert back.retriable is cls.retriable
    assert status_of(_instance(back)) == st
    if back is not e.StagetreeError:
        assert st.grpc.name == cls.code  # the name each class carries (the REST body's "error") agrees


def test_a_subclass_answers_as_its_parent_and_a_foreign_exception_is_internal() -> None:
    assert status_of(e.SequenceError("f", "g", "m")) == TABLE[e.InvalidArgument]
    assert status_of(ValueError("x")) == INTERNAL


@pytest.mark.parametrize("code", list(grpc.StatusCode))
def test_every_status_code_has_a_defined_class(code: grpc.StatusCode) -> None:
    cls = error_class_of(code)
    err = error_of_code(code, "GetPlan: details")
    assert type(err) is cls and err.message.startswith("GetPlan: details")
    assert err.retriable is (code in RETRIED)  # only what a retry can fix, decided by the class
    if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS, grpc.StatusCode.OK):
        assert cls is e.StagetreeError and SERVER_BUG in err.message and code.name in err.message
    if code is grpc.StatusCode.ABORTED:
        assert cls is e.Conflict
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        assert cls is e.Unavailable


@pytest.mark.parametrize(
    "code",
    [grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS, grpc.StatusCode.CANCELLED],
)
def test_the_node_manager_link_does_not_retry_a_master_bug(code: grpc.StatusCode) -> None:
    err = translate(AioRpcError(code, Metadata(), Metadata(), "boom"), "h:1", "report")
    assert not err.retriable and "boom" in err.message and "h:1" in err.message and code.name in err.message
    if code is not grpc.StatusCode.CANCELLED:
        assert "bug in the master" in err.message


def test_the_link_retries_what_a_retry_can_fix() -> None:
    for code in RETRIED:
        assert translate(AioRpcError(code, Metadata(), Metadata(), "x"), "h:1", "report").retriable, code


def test_there_is_one_status_table() -> None:
    assert [p.relative_to(SERVICES).as_posix() for p in status_tables(SERVICES)] == ["status.py"]
    assert count_status_tables(SERVICES) == 1


# Abridged from the layout before the one table: the master's table, the SDK's inverse of it, and the
# link's own set of retried codes plus a dict of the rest. A code used once is no table.
OLD_LAYOUT = {
    "master/errors.py": "STATUS = {e.NotFound: Status(grpc.StatusCode.NOT_FOUND, 404), e.StagetreeError: S}\n",
    "client/sdk.py": (
        "STATUS_ERRORS: dict = {grpc.StatusCode.NOT_FOUND: NotFound, grpc.StatusCode.ABORTED: Conflict}\n"
        "if exc.code() == grpc.StatusCode.CANCELLED:\n    pass\n"
    ),
    "nodemanager/link.py": (
        "from grpc import StatusCode\n"
        "_RETRIABLE = {StatusCode.UNAVAILABLE, StatusCode.INTERNAL}\n"
        "def translate(code):\n"
        "    by_code = {StatusCode.NOT_FOUND: errors.NotFound}\n"
    ),
    "master/api/grpc_api.py": "async def f(context):\n    await context.abort(grpc.StatusCode.NOT_FOUND, 'x')\n",
}


def test_the_counter_counts_each_module_with_a_table_once(tmp_path: Path) -> None:
    for name, text in OLD_LAYOUT.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert count_status_tables(tmp_path) == 3
