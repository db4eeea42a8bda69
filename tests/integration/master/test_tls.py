"""The master over TLS, started the way ``stagetree master serve`` starts it (``MasterApp.run``), with a
throwaway CA made here: verified clients (SDK, node-manager link, CLI's REST client) get in; a client with
another CA, without a client certificate (mutual TLS) or in plaintext is refused."""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

import stagetree
from stagetree.bus.tansu import free_loopback_port
from stagetree.client.cli import RestClient
from stagetree.core.errors import Unavailable
from stagetree.core.slots import SlotInfo
from stagetree.master.app import MasterApp
from stagetree.master.coordination import InProcessCoordination
from stagetree.nodemanager.link import GrpcMasterLink
from stagetree.tls import ClientTls, IssuedFiles, ServerTls, issue_certificates
from tests.integration.conftest import ADMIN_TOKEN, TOKENS, master_settings


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[IssuedFiles, IssuedFiles]:
    root: Path = tmp_path_factory.mktemp("pki")
    return issue_certificates(root / "ours"), issue_certificates(root / "theirs", ca_name="someone else's CA")


@asynccontextmanager
async def serving(sqlite_url: str, tls: ServerTls, ca: Path) -> AsyncIterator[MasterApp]:
    settings = master_settings(sqlite_url, grpc_port=free_loopback_port(), http_port=free_loopback_port(), tls=tls)
    app = MasterApp.build(settings, coordination=InProcessCoordination())
    stop = asyncio.Event()
    task = asyncio.create_task(app.run(stop))
    ctx = ClientTls(ca_file=str(ca)).ssl_context()
    url = f"https://127.0.0.1:{settings.http_port}/api/v1/health"
    deadline = time.monotonic() + 20
    while True:
        assert not task.done(), task
        try:
            await asyncio.to_thread(urllib.request.urlopen, url, timeout=1, context=ctx)
            break
        except OSError:
            assert time.monotonic() < deadline, "the master's REST health route never answered"
            await asyncio.sleep(0.05)
    try:
        yield app
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)


async def _lists(target: str, tls: ClientTls | bool) -> bool:
    """Whether an SDK client with ``tls`` gets an answer (False: refused, Unavailable)."""
    async with stagetree.connect(target, token=TOKENS["alice"], tls=tls, retries=1, timeout_s=5) as client:
        try:
            await client.list_studies()
            return True
        except Unavailable:
            return False


async def test_mutual_tls_lets_in_only_clients_our_ca_signed(
    sqlite_url: str, pki: tuple[IssuedFiles, IssuedFiles]
) -> None:
    ours, theirs = pki
    tls = ServerTls(
        cert_file=str(ours.server_cert), key_file=str(ours.server_key), ca_file=str(ours.ca_cert), client_auth=True
    )
    async with serving(sqlite_url, tls, ours.ca_cert) as app:
        target = f"127.0.0.1:{app.settings.grpc_port}"
        full = ClientTls(ca_file=str(ours.ca_cert), cert_file=str(ours.client_cert), key_file=str(ours.client_key))
        assert await _lists(target, full)
        # the wrong CA: the master's certificate does not verify
        wrong_ca = full.model_copy(update={"ca_file": str(theirs.ca_cert)})
        assert not await _lists(target, wrong_ca)
        # the right CA but a client certificate another CA signed, or none: the master refuses the handshake
        foreign = full.model_copy(update={"cert_file": str(theirs.client_cert), "key_file": str(theirs.client_key)})
        assert not await _lists(target, foreign)
        assert not await _lists(target, ClientTls(ca_file=str(ours.ca_cert)))
        assert not await _lists(target, False)  # plaintext to a TLS port

        # the node manager's link: refused without a client certificate, registered with one
        slots = [SlotInfo("cpu-0", cpu_cores=1)]
        bare = GrpcMasterLink(target, ADMIN_TOKEN, rpc_timeout_s=5, tls=ClientTls(ca_file=str(ours.ca_cert)))
        with pytest.raises(Unavailable, match="STAGETREE_NM_TLS__CERT_FILE"):
            await bare.register("nm-bare", "host", slots)
        await bare.close()
        link = GrpcMasterLink(target, ADMIN_TOKEN, rpc_timeout_s=5, tls=full)
        assert await link.register("nm-tls", "host", slots) > 0
        await link.close()

        # REST (the CLI, dashboards, CI) is server TLS: verified with our CA, refused with another
        base = f"https://127.0.0.1:{app.settings.http_port}"
        ok = RestClient(base, TOKENS["alice"], ssl_context=ClientTls(ca_file=str(ours.ca_cert)).ssl_context())
        # the database is shared with other tests: what matters is that the verified call is answered
        assert isinstance(await asyncio.to_thread(ok.get, "/studies"), list)
        bad = RestClient(base, TOKENS["alice"], ssl_context=ClientTls(ca_file=str(theirs.ca_cert)).ssl_context())
        with pytest.raises(Unavailable, match="CERTIFICATE_VERIFY_FAILED"):
            await asyncio.to_thread(bad.get, "/studies")


async def test_server_tls_needs_only_the_ca_and_plaintext_beyond_loopback_is_loud(
    sqlite_url: str, pki: tuple[IssuedFiles, IssuedFiles], caplog: pytest.LogCaptureFixture
) -> None:
    ours, theirs = pki
    tls = ServerTls(cert_file=str(ours.server_cert), key_file=str(ours.server_key))
    async with serving(sqlite_url, tls, ours.ca_cert) as app:
        target = f"127.0.0.1:{app.settings.grpc_port}"
        assert await _lists(target, ClientTls(ca_file=str(ours.ca_cert)))
        assert not await _lists(target, ClientTls(ca_file=str(theirs.ca_cert)))
        assert app.warn_if_exposed() == []

    exposed = MasterApp.build(
        master_settings(sqlite_url, grpc_host="0.0.0.0", http_host="127.0.0.1"), coordination=InProcessCoordination()
    )
    try:
        with caplog.at_level(logging.WARNING, logger="stagetree.master.app"):
            warnings = exposed.warn_if_exposed()
        assert len(warnings) == 1 and "PLAINTEXT gRPC on 0.0.0.0" in warnings[0]
        assert "STAGETREE_MASTER_TLS__CERT_FILE" in caplog.text
        loopback = MasterApp.build(master_settings(sqlite_url), coordination=InProcessCoordination())
        assert loopback.warn_if_exposed() == []  # the embedded default: plaintext on loopback, quietly
        loopback.close()
    finally:
        exposed.close()
