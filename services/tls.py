"""TLS between the master and everything that dials it: settings, credentials, and a throwaway CA.

This module owns the two TLS settings groups and what they turn into:

* ``ServerTls`` (the master: ``STAGETREE_MASTER_TLS__CERT_FILE``, ``__KEY_FILE``, ``__CA_FILE``,
  ``__CLIENT_AUTH``) -> gRPC server credentials and uvicorn's ``ssl_*`` arguments. ``client_auth`` is
  mutual TLS on gRPC: every caller (node managers, SDK clients) must show a certificate ``ca_file`` signed.
* ``ClientTls`` (the node manager's ``STAGETREE_NM_TLS__*``; the SDK's and the CLI's ``STAGETREE_TLS_CA_FILE``,
  ``STAGETREE_TLS_CERT_FILE``, ``STAGETREE_TLS_KEY_FILE``, ``STAGETREE_TLS_SERVER_NAME``, ``STAGETREE_TLS_ENABLED``)
  -> gRPC channel credentials and an ``ssl.SSLContext`` that verify the master's certificate against a CA
  bundle (``ca_file``; the system's roots when empty) and, for mTLS, present a client certificate.

Plaintext is for loopback: ``is_loopback`` tells the master whether to warn that it serves in clear.
``issue_certificates`` makes a CA and certificates signed by it (the ``cryptography`` package, a dev
dependency): the process cluster's TLS option and the tests use it; production brings its own PKI.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from pydantic import BaseModel, model_validator

from stagetree.core.errors import InvalidArgument

ENV_CLIENT_PREFIX = "STAGETREE_TLS_"  # the SDK's and the CLI's: STAGETREE_TLS_CA_FILE, ..._CERT_FILE, ...


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as e:
        raise InvalidArgument(f"{what}: cannot read {path!r} ({e.strerror or e})") from None


class ServerTls(BaseModel):
    """The master's certificate; empty ``cert_file``: plaintext."""

    cert_file: str = ""  # PEM certificate chain the master presents (gRPC and REST)
    key_file: str = ""  # its PEM private key
    ca_file: str = ""  # PEM CA bundle that signs client certificates (mutual TLS)
    client_auth: bool = False  # mutual TLS on gRPC: refuse callers without a certificate ca_file signed

    @model_validator(mode="after")
    def _check(self) -> ServerTls:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("tls: cert_file and key_file go together (set both, or neither for plaintext)")
        if self.client_auth and not (self.cert_file and self.ca_file):
            raise ValueError("tls.client_auth (mutual TLS) needs cert_file, key_file and ca_file (the clients' CA)")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file)

    def grpc_credentials(self) -> grpc.ServerCredentials:
        key, cert = _read(self.key_file, "tls.key_file"), _read(self.cert_file, "tls.cert_file")
        ca = _read(self.ca_file, "tls.ca_file") if self.ca_file else None
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=self.client_auth)

    def uvicorn_options(self) -> dict[str, Any]:
        """uvicorn.Config arguments: REST is server TLS only (browsers and CI jobs carry bearer tokens)."""
        if not self.enabled:
            return {}
        for path, what in ((self.cert_file, "tls.cert_file"), (self.key_file, "tls.key_file")):
            _read(path, what)  # a clear error before uvicorn's
        return {"ssl_certfile": self.cert_file, "ssl_keyfile": self.key_file}


class ClientTls(BaseModel):
    """How a client verifies the master (and proves itself, for mTLS). ``enabled`` None: on when any
    file is set."""

    enabled: bool | None = None
    ca_file: str = ""  # PEM CA bundle that signed the master's certificate; empty: the system's roots
    cert_file: str = ""  # client certificate (mutual TLS)
    key_file: str = ""
    server_name: str = ""  # the name to check in the master's certificate, when not the target's host

    @model_validator(mode="after")
    def _check(self) -> ClientTls:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("tls: cert_file and key_file go together (a client certificate needs its key)")
        return self

    @property
    def on(self) -> bool:
        return self.enabled if self.enabled is not None else bool(self.ca_file or self.cert_file)

    def grpc_credentials(self) -> grpc.ChannelCredentials:
        ca = _read(self.ca_file, "tls.ca_file") if self.ca_file else None
        key = _read(self.key_file, "tls.key_file") if self.key_file else None
        cert = _read(self.cert_file, "tls.cert_file") if self.cert_file else None
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def channel_options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    def ssl_context(self) -> ssl.SSLContext:
        """For HTTPS (the CLI's REST calls, health checks)."""
        ctx = ssl.create_default_context(cafile=self.ca_file or None)
        if self.cert_file:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> ClientTls:
        """``STAGETREE_TLS_CA_FILE``, ``_CERT_FILE``, ``_KEY_FILE``, ``_SERVER_NAME`` and ``_ENABLED``."""
        env = dict(os.environ if environ is None else environ)
        values: dict[str, Any] = {}
        for name in cls.model_fields:
            v = env.get(ENV_CLIENT_PREFIX + name.upper())
            if v:
                values[name] = v
        return cls.model_validate(values)


def open_channel(target: str, tls: ClientTls | None, options: list[tuple[str, Any]]) -> grpc.aio.Channel:
    """A ``grpc.aio`` channel to ``target``: verified TLS when ``tls`` is on, else plaintext."""
    if tls is not None and tls.on:
        return grpc.aio.secure_channel(target, tls.grpc_credentials(), options=options + tls.channel_options())
    return grpc.aio.insecure_channel(target, options=options)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a bind address or name) only listens on / reaches this machine."""
    host = host.strip("[]")
    if not host:
        return False  # "" binds every interface
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return all(ipaddress.ip_address(a[4][0]).is_loopback for a in socket.getaddrinfo(host, None))
        except (OSError, ValueError):
            return False


# -- a throwaway CA (tests, the process cluster) --------------------------------------------------------


@dataclass(frozen=True)
class IssuedFiles:
    """PEM files written by ``issue_certificates``."""

    ca_cert: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def issue_certificates(
    directory: Path,
    *,
    hosts: tuple[str, ...] = ("127.0.0.1", "localhost"),
    ca_name: str = "stagetree test CA",
    client_name: str = "stagetree-nodemanager",
) -> IssuedFiles:
    """A fresh CA, a server certificate for ``hosts`` and a client certificate, all signed by it, written
    as PEM files into ``directory`` (keys readable by the owner only). Valid for a day."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        path.chmod(0o600)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name(ca_name))
        .issuer_name(name(ca_name))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )  # key_cert_sign, crl_sign
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(cn: str, sans: list[x509.GeneralName], usage: x509.ObjectIdentifier) -> tuple[x509.Certificate, Any]:
        key = ec.generate_private_key(ec.SECP256R1())
        b = (
            x509.CertificateBuilder()
            .subject_name(name(cn))
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if sans:
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return b.sign(ca_key, hashes.SHA256()), key

    sans: list[x509.GeneralName] = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    server, server_key = leaf(hosts[0], sans, ExtendedKeyUsageOID.SERVER_AUTH)
    client, client_key = leaf(client_name, [], ExtendedKeyUsageOID.CLIENT_AUTH)
    files = IssuedFiles(
        directory / "ca.pem",
        directory / "server.pem",
        directory / "server-key.pem",
        directory / "client.pem",
        directory / "client-key.pem",
    )
    pem = serialization.Encoding.PEM
    files.ca_cert.write_bytes(ca.public_bytes(pem))
    files.server_cert.write_bytes(server.public_bytes(pem))
    write_key(server_key, files.server_key)
    files.client_cert.write_bytes(client.public_bytes(pem))
    write_key(client_key, files.client_key)
    return files
