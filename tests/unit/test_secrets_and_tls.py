"""Settings from secret files (``<NAME>_FILE``), the TLS settings' rules, and how ``stagetree.connect``
and the CLI pick their TLS and token (stagetree.filevars, stagetree.tls)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

import stagetree
from stagetree.client import cli
from stagetree.core.errors import InvalidArgument
from stagetree.envcheck import unknown_variables
from stagetree.filevars import env_or_file
from stagetree.master.settings import MasterSettings
from stagetree.nodemanager.settings import NodeManagerSettings
from stagetree.tls import ClientTls, ServerTls, is_loopback


def _secret(tmp_path: Path, name: str, content: str) -> str:
    path = tmp_path / name
    path.write_text(content + "\n")  # a trailing newline, as `kubectl create secret --from-file` keeps
    return str(path)


def test_every_setting_can_come_from_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STAGETREE_MASTER_AUTH__ADMIN_TOKEN_FILE", _secret(tmp_path, "admin", "s3cr3t-admin"))
    monkeypatch.setenv("STAGETREE_MASTER_AUTH__TOKENS_FILE", _secret(tmp_path, "tokens", json.dumps({"al": "t-al"})))
    monkeypatch.setenv("STAGETREE_MASTER_DATABASE_URL_FILE", _secret(tmp_path, "db", "postgresql://u:pw@db/x"))
    monkeypatch.setenv("STAGETREE_NM_ADMIN_TOKEN_FILE", str(tmp_path / "admin"))
    s = MasterSettings()
    assert s.auth.admin_token.get_secret_value() == "s3cr3t-admin"
    assert {k: v.get_secret_value() for k, v in s.auth.tokens.items()} == {"al": "t-al"}
    assert s.database_url == "postgresql://u:pw@db/x"
    assert "s3cr3t" not in repr(s) and "t-al" not in repr(s)
    assert NodeManagerSettings().admin_token.get_secret_value() == "s3cr3t-admin"
    # a known setting's file variant is not a typo; a typo's is
    env = {"STAGETREE_MASTER_AUTH__ADMIN_TOKEN_FILE": "x", "STAGETREE_MASTER_AUTH_ADMIN_TOKEN_FILE": "x"}
    (msg,) = unknown_variables(MasterSettings, "STAGETREE_MASTER_", env)
    assert msg.startswith("STAGETREE_MASTER_AUTH_ADMIN_TOKEN_FILE is not a setting")


def test_a_variable_and_its_file_together_or_an_unreadable_file_are_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STAGETREE_NM_ADMIN_TOKEN", "inline")
    monkeypatch.setenv("STAGETREE_NM_ADMIN_TOKEN_FILE", _secret(tmp_path, "admin", "from-file"))
    with pytest.raises(InvalidArgument, match="STAGETREE_NM_ADMIN_TOKEN and STAGETREE_NM_ADMIN_TOKEN_FILE"):
        NodeManagerSettings()
    monkeypatch.delenv("STAGETREE_NM_ADMIN_TOKEN")
    monkeypatch.setenv("STAGETREE_NM_ADMIN_TOKEN_FILE", str(tmp_path / "missing"))
    with pytest.raises(InvalidArgument, match="cannot read the file"):
        NodeManagerSettings()
    assert env_or_file("T", {"T_FILE": _secret(tmp_path, "t", "tok")}) == "tok"
    assert env_or_file("T", {"T": "inline"}) == "inline" and env_or_file("T", {}) is None


def test_tls_settings_refuse_half_configurations(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="cert_file and key_file go together"):
        ServerTls(cert_file="c.pem")
    with pytest.raises(ValueError, match="needs cert_file, key_file and ca_file"):
        ServerTls(cert_file="c.pem", key_file="k.pem", client_auth=True)
    with pytest.raises(ValueError, match="cert_file and key_file go together"):
        ClientTls(ca_file="ca.pem", cert_file="c.pem")
    monkeypatch.setenv("STAGETREE_MASTER_TLS__CERT_FILE", "/etc/tls/tls.crt")
    monkeypatch.setenv("STAGETREE_MASTER_TLS__KEY_FILE", "/etc/tls/tls.key")
    assert MasterSettings().tls.enabled
    assert not ClientTls().on and ClientTls(ca_file="ca.pem").on and ClientTls(enabled=True).on
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("")


async def test_connect_picks_tls_from_the_argument_the_scheme_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("STAGETREE_TLS_CA_FILE", raising=False)
    async with stagetree.connect("127.0.0.1:1", token="t") as plain:
        assert plain.tls is None
    async with stagetree.connect("grpcs://127.0.0.1:1", token="t") as by_scheme:
        assert by_scheme.tls is not None and by_scheme.target == "127.0.0.1:1"
    async with stagetree.connect("127.0.0.1:1", token="t", tls=True) as explicit:
        assert explicit.tls is not None
    ca = tmp_path / "ca.pem"
    ca.write_text("")  # only its path is used until the first call
    monkeypatch.setenv("STAGETREE_TLS_CA_FILE", str(ca))
    async with stagetree.connect("127.0.0.1:1", token="t") as from_env:
        assert from_env.tls is not None and from_env.tls.ca_file == str(ca)
    async with stagetree.connect("127.0.0.1:1", token="t", tls=False) as off:
        assert off.tls is None
    with pytest.raises(InvalidArgument, match="tls: must be"):
        stagetree.connect("127.0.0.1:1", tls="yes")  # type: ignore[arg-type]


def test_cli_reads_the_token_from_a_file_and_never_takes_two(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STAGETREE_TOKEN", raising=False)
    path = _secret(tmp_path, "token", "file-token")
    assert cli._token(argparse.Namespace(token=None, token_file=path)) == "file-token"
    monkeypatch.setenv("STAGETREE_TOKEN_FILE", path)
    assert cli._token(argparse.Namespace(token=None, token_file=None)) == "file-token"
    with pytest.raises(InvalidArgument, match="give one"):
        cli._token(argparse.Namespace(token="x", token_file=path))
