"""The error table, bearer-token authentication and the settings class."""

from __future__ import annotations

import grpc
import pytest
from pydantic import SecretStr

from stagetree.core import errors as e
from stagetree.master.auth import Authenticator, bearer
from stagetree.master.settings import AuthSettings, MasterSettings
from stagetree.status import INTERNAL, status_of


@pytest.mark.parametrize("cls", e.ALL_ERRORS)
def test_every_error_maps_to_the_code_it_names(cls: type[e.StagetreeError]) -> None:
    exc = cls("f", "x", "y") if cls is e.SequenceError else cls("boom")  # type: ignore[call-arg]
    st = status_of(exc)
    if cls is e.StagetreeError:
        assert st.grpc is grpc.StatusCode.UNKNOWN
    else:
        assert st.grpc.name == cls.code


def test_statuses_of_the_issue() -> None:
    assert status_of(e.InvalidArgument("x")).http == 422
    assert status_of(e.SequenceError("f", "g", "m")).http == 422
    assert status_of(e.NotFound("x")).http == 404
    assert status_of(e.ResourceExhausted("x")).http == 413
    assert status_of(e.Unauthenticated("x")).http == 401
    assert status_of(e.PermissionDenied("x")).http == 403
    assert status_of(ValueError("x")) == INTERNAL


def test_bearer_header_parsing() -> None:
    assert bearer("Bearer abc") == "abc"
    assert bearer("bearer  abc ") == "abc"
    assert bearer("Basic abc") is None
    assert bearer("Bearer ") is None
    assert bearer(None) is None


def test_authenticator() -> None:
    auth = Authenticator(
        AuthSettings(tokens={"alice": SecretStr("a1"), "bob": SecretStr("b1")}, admin_token=SecretStr("adm"))
    )
    assert auth.authenticate("a1").name == "alice" and not auth.authenticate("a1").admin
    assert auth.authenticate("adm").admin
    with pytest.raises(e.Unauthenticated):
        auth.authenticate("zzz")
    with pytest.raises(e.Unauthenticated):
        auth.authenticate(None)
    with pytest.raises(e.PermissionDenied):
        auth.authenticate("b1").require_admin()
    no_admin = Authenticator(AuthSettings())
    with pytest.raises(e.Unauthenticated):
        no_admin.authenticate("")


def test_settings_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STAGETREE_MASTER_DATABASE_URL", "postgresql+psycopg2://u@h/db")
    monkeypatch.setenv("STAGETREE_MASTER_AUTH__ADMIN_TOKEN", "s3cret")
    monkeypatch.setenv("STAGETREE_MASTER_AUTH__TOKENS", '{"alice": "tok"}')
    monkeypatch.setenv("STAGETREE_MASTER_LIMITS__MAX_BATCH_ITEMS", "7")
    s = MasterSettings()
    assert s.database_url.endswith("/db") and s.limits.max_batch_items == 7
    assert s.auth.admin_token.get_secret_value() == "s3cret"
    assert s.auth.tokens["alice"].get_secret_value() == "tok"
    assert "s3cret" not in repr(s)
