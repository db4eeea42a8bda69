"""The asyncio client SDK: connect to a master over gRPC, create or load a ``Study``, evaluate configs.

::

    async with stagetree.connect("127.0.0.1:50051", token="...") as client:
        study = await Study.create(client, "lr-sweep", trainer="pkg.train:Net", dataset="cifar10", tuned=["lr"])
        metrics = await study.eval({"lr": MultiStep(0.1, [30], 0.1)}, step=40)

This module owns:

* ``Client`` (what ``connect`` returns): the channel, the bearer metadata, a per-method RPC counter
  (``client.rpcs``), retries of idempotent calls on retriable errors, and ``error_of``, which turns a
  gRPC status back into the core error tree (``stagetree.core.errors``) with a message that says what
  to do. Status codes map back to errors through the one table, ``stagetree.status``.
* ``Study``: ``submit``/``eval`` (validated client-side with the core's own functions, so a bad config
  fails before any RPC), ``cancel``, ``results``, ``best``, ``metrics`` and ``plan``.
* The batching of concurrent evals: every eval submitted while a batch is collected (the rest of the
  current event-loop tick plus ``window_s``) goes out in one ``SubmitRequests`` of at most ``max_batch``
  items, and the requests it leaves waiting are followed by the study's one ``StreamResults``, reopened
  wider when a new batch leaves more requests waiting (so one RPC per batch at most). Each
  eval carries its own client request id (a uuid), so resending a batch after a lost answer never
  creates a request twice.

An eval whose work failed raises ``EvalFailed``; one cancelled (by ``Study.cancel`` or by cancelling the
task awaiting it, which cancels the request on the master too) raises ``EvalCancelled``. Both are
``StagetreeError`` subclasses, not retriable.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import random
import re
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import grpc

from stagetree.client.codeversion import check_trainer, code_digest
from stagetree.core.batch import CurveSampling
from stagetree.core.config import Config, FixedPart
from stagetree.core.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    StagetreeError,
    Unauthenticated,
    Unavailable,
)
from stagetree.core.lifecycle import FINISHED_REQUEST_STATES
from stagetree.core.loglines import LoggedLine
from stagetree.core.searchplan import check_step
from stagetree.core.seqforms import config_family_json
from stagetree.core.sequences import Sequence, as_sequence
from stagetree.core.sharing import SharingStats
from stagetree.filevars import env_or_file
from stagetree.proto.stagetree.v1 import master_pb2 as pb
from stagetree.proto.stagetree.v1 import master_pb2_grpc as pb_grpc
from stagetree.status import error_class_of, error_of_code
from stagetree.tls import ENV_CLIENT_PREFIX, ClientTls, is_loopback, open_channel

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_TARGET = "127.0.0.1:50051"
ENV_TARGET = "STAGETREE_MASTER"
ENV_TOKEN = "STAGETREE_TOKEN"
MAX_CONFIG_BYTES = 64 * 1024  # the master's default limit; a larger config fails here, before any RPC
TERMINAL = frozenset(str(s) for s in FINISHED_REQUEST_STATES)
_STUDY_ID = re.compile(r"[0-9a-f]{32}")

# ---------------------------------------------------------------------------------------------
# Errors


class EvalFailed(StagetreeError):
    """The training behind an eval failed more often than the master's retry limit; ``error`` says why."""

    code = "FAILED"


class EvalCancelled(StagetreeError):
    """The eval was cancelled (``Study.cancel``, a cancelled awaiting task, or another client)."""

    code = "CANCELLED"


_HINTS: dict[type[StagetreeError], str] = {
    Unauthenticated: f"pass the token your operator gave you: stagetree.connect(url, token=...) or ${ENV_TOKEN}",
    Unavailable: "check that the master is running and reachable at this address, and that TLS matches its "
    "(tls=ClientTls(ca_file=...) for a master with a certificate), then retry",
}


def retry_after_s(exc: grpc.RpcError) -> float | None:
    """When the master shed a call as overloaded (RESOURCE_EXHAUSTED with ``retry-after-ms``, see
    ``stagetree.master.api.admission``), the seconds it asks the caller to wait; else None."""
    code_fn, trailers_fn = getattr(exc, "code", None), getattr(exc, "trailing_metadata", None)
    if not callable(code_fn) or not callable(trailers_fn) or code_fn() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return None
    for key, value in trailers_fn() or ():
        if key == "retry-after-ms":
            with contextlib.suppress(ValueError):
                return min(60.0, max(0.0, int(value) / 1000))
    return None


def error_of(exc: BaseException, rpc: str = "", target: str = "") -> StagetreeError:
    """The core error for a failed RPC (a ``grpc.RpcError``), through the status table; a code outside it
    (INTERNAL, UNKNOWN, ...) is a base error, not retriable, that points at the master's log."""
    if isinstance(exc, StagetreeError):
        return exc
    code_fn = getattr(exc, "code", None)
    details_fn = getattr(exc, "details", None)
    code = code_fn() if isinstance(exc, grpc.RpcError) and callable(code_fn) else None
    details = (details_fn() if callable(details_fn) else None) or ""
    where = f"{rpc}: " if rpc else ""
    if not isinstance(code, grpc.StatusCode):  # no status at all: not an answer from a server
        err = StagetreeError(
            f"{where}{details or exc!r} ({type(exc).__name__}); this is a bug in the master or the SDK: "
            "see the master's log"
        )
    else:
        msg = f"{where}{details or code.name}"
        hint = _HINTS.get(error_class_of(code))
        if hint is not None:
            msg += f" (master at {target or '?'}; {hint})"
        err = error_of_code(code, msg)
    err.__cause__ = exc
    return err


# ---------------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class EvalResult:
    """A finished eval: its request on the master, the point it resolved to, and its metrics."""

    request_id: int
    client_request_id: str
    state: str  # DONE | CANCELLED | FAILED
    step: int
    node: int
    metrics: dict[str, float]
    config: dict[str, Sequence] | None = None  # None when another client submitted it
    error: str = ""
    label: str = ""  # the trial it belongs to, as the tuner named it
    # the trainer code version of the plan it is on, and that plan's key: a study loaded by edited code
    # keeps its old results, marked with the old version (``Study.create(..., load_if_exists=True)``)
    code_version: str = ""
    plan_key: str = ""


# A line of text a trainer logged (``Trainer.log_text``) in a batch attempt that trained a request.
TrainerLine = LoggedLine


@dataclass(frozen=True)
class StudyInfo:
    id: str
    name: str
    owner: str
    fixed: FixedPart | None
    created_at: float
    policies: dict[str, Any] | None = None  # the scheduling policies it chose (stagetree.master.policies)
    retry_user_errors: bool = False
    curve_every_steps: int | None = None  # None: the master's default
    curve_max_per_s: float | None = None


def _study_info(s: pb.Study) -> StudyInfo:
    every = s.curve_every_steps if s.HasField("curve_every_steps") else None
    rate = s.curve_max_per_s if s.HasField("curve_max_per_s") else None
    fixed, policies = None, None
    if s.fixed_json:
        obj = json.loads(s.fixed_json)
        policies = obj.pop("policies", None) if isinstance(obj, dict) else None
        fixed = FixedPart.from_json(obj)
    return StudyInfo(s.id, s.name, s.owner, fixed, s.created_at, policies, s.retry_user_errors, every, rate)


_STATE_NAMES = {v.number: v.name for v in pb.RequestState.DESCRIPTOR.values}  # Name() is a slow lookup


def _state_name(value: int) -> str:
    name = _STATE_NAMES.get(value)
    return str(pb.RequestState.Name(value)) if name is None else name  # Name raises on an unknown value


class Evaluation:
    """One submitted eval. ``await evaluation`` gives its metrics; ``await evaluation.result()`` the whole
    ``EvalResult``. ``request_id`` is set once the batch carrying it was answered."""

    def __init__(self, study: Study, config: dict[str, Sequence], config_json: str, step: int, label: str = "") -> None:
        self.study = study
        self.config = config
        self.config_json = config_json
        self.step = step
        self.label = label
        self.client_request_id = uuid.uuid4().hex
        self.request_id: int | None = None
        self._future: asyncio.Future[EvalResult] = asyncio.get_running_loop().create_future()
        self._future.add_done_callback(self._on_done)

    def done(self) -> bool:
        return self._future.done()

    def add_done_callback(self, fn: Callable[[Evaluation], None]) -> None:
        """Call ``fn(self)`` once the eval finished (whatever the outcome)."""
        self._future.add_done_callback(lambda _f: fn(self))

    async def result(self) -> EvalResult:
        """The finished eval; raises ``EvalFailed`` / ``EvalCancelled`` or the error of its RPC."""
        return await self._future

    def outcome(self) -> EvalResult | BaseException:
        """For a finished eval: its result or its error (never raises)."""
        if self._future.cancelled():
            return EvalCancelled(f"eval {self.client_request_id} was cancelled")
        exc = self._future.exception()
        return exc if exc is not None else self._future.result()

    def __await__(self) -> Generator[Any, None, dict[str, float]]:
        result = yield from self._future.__await__()
        return dict(result.metrics)

    # -- completion (called by the study) ------------------------------------------------------

    def _finish(self, r: pb.RequestResult) -> EvalResult | None:
        state = _state_name(r.state)
        res = EvalResult(
            r.request_id,
            r.client_request_id,
            state,
            r.step,
            r.node,
            dict(r.metrics),
            self.config,
            r.error,
            r.label,
            r.code_version or self.study.code_version,
            r.plan_key,
        )
        if self._future.done():
            return None
        if state == "DONE":
            self._future.set_result(res)
        elif state == "FAILED":
            self._future.set_exception(EvalFailed(f"eval at step {self.step} failed: {res.error or 'no reason given'}"))
        else:
            why = f": {res.error}" if res.error else ""  # e.g. a search policy killed the trial
            self._future.set_exception(EvalCancelled(f"request {r.request_id} was cancelled{why}"))
        return res

    def _fail(self, exc: BaseException) -> None:
        if not self._future.done():
            self._future.set_exception(exc)

    def _on_done(self, fut: asyncio.Future[EvalResult]) -> None:
        if fut.cancelled():  # the awaiting task was cancelled: cancel the request on the master too
            self.study._abandon(self)
        elif fut.exception() is not None:
            pass  # retrieved here so an unobserved failure does not log "exception never retrieved"


# ---------------------------------------------------------------------------------------------
# Client


def never_sent(exc: grpc.RpcError) -> bool:
    """Whether a call failed before any connection to the master carried it (UNAVAILABLE, "failed to
    connect": e.g. the master's handshake timed out on a loaded host), so nothing of it was done."""
    code = exc.code() if callable(getattr(exc, "code", None)) else None
    details = exc.details() if callable(getattr(exc, "details", None)) else ""
    return code == grpc.StatusCode.UNAVAILABLE and "failed to connect" in (details or "")


class Client:
    """A connection to a master (``grpc.aio``). Use ``stagetree.connect``; close it (or use ``async with``).

    ``window_s``: how long a batch of evals is collected after the tick that opened it; ``max_batch``:
    the most items per ``SubmitRequests`` (lowered automatically when the master says its limit is
    smaller); ``retries``: attempts of an idempotent call that fails with a retriable error;
    ``timeout_s``: the deadline of each unary call; ``reconnect_s``: once the master has answered, how
    long an idempotent call or a result stream keeps retrying past ``retries`` while it is unavailable
    (a master restart), with backoff capped at 2 s. A master that never answered fails after ``retries``.
    A call the master sheds as overloaded (RESOURCE_EXHAUSTED with a retry-after) is retried after the
    time it asks for, idempotent or not (nothing of it was done), for up to ``reconnect_s``; so is one that
    no connection carried (``never_sent``), as an idempotent one is.
    """

    def __init__(
        self,
        target: str,
        token: str | None,
        *,
        window_s: float = 0.002,
        max_batch: int = 1000,
        retries: int = 6,
        timeout_s: float = 60.0,
        reconnect_s: float = 120.0,
        channel: grpc.aio.Channel | None = None,
        tls: ClientTls | None = None,
    ) -> None:
        if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
            raise InvalidArgument(f"max_batch: must be an int >= 1, got {max_batch!r}")
        if not isinstance(window_s, int | float) or not 0 <= window_s <= 10:
            raise InvalidArgument(f"window_s: must be a number of seconds in [0, 10], got {window_s!r}")
        self.target = target
        self.window_s = float(window_s)
        self.max_batch = max_batch
        self.retries = max(1, int(retries))
        self.timeout_s = timeout_s
        self.reconnect_s = float(reconnect_s)
        self.reached = False  # the master answered once: Unavailable from now on is a restart, waited for
        self.rpcs: Counter[str] = Counter()
        self.shed = 0  # calls the master refused as overloaded (each retried after its retry-after)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.tls = tls if tls is not None and tls.on else None
        if self.tls is None and not is_loopback(target.rsplit(":", 1)[0]):
            log.warning(
                "connecting to %s in plaintext: pass tls=... to stagetree.connect (or set %sCA_FILE)",
                target,
                ENV_CLIENT_PREFIX,
            )
        self._channel = channel or open_channel(
            target,
            self.tls,
            [
                ("grpc.max_receive_message_length", 64 << 20),
                ("grpc.max_send_message_length", 64 << 20),
                # reconnect soon after a master restart (the default backoff grows to minutes)
                ("grpc.initial_reconnect_backoff_ms", 200),
                ("grpc.min_reconnect_backoff_ms", 200),
                ("grpc.max_reconnect_backoff_ms", 2000),
            ],
        )
        self.stub = pb_grpc.MasterServiceStub(self._channel)  # type: ignore[no-untyped-call]
        self._studies: list[Study] = []
        self._closed = False

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def rpc_count(self) -> int:
        """RPCs this client started (a retry counts again; a server stream counts once)."""
        return sum(self.rpcs.values())

    async def close(self) -> None:
        """Stop result streams, fail evals still outstanding with ``Unavailable``, close the channel."""
        if self._closed:
            return
        self._closed = True
        for s in self._studies:
            await s._close()
        await self._channel.close()

    # -- studies ---------------------------------------------------------------------------------

    async def create_study(
        self,
        name: str,
        *,
        trainer: str,
        dataset: str = "",
        model: str = "",
        seed: int = 0,
        values: Mapping[str, Any] | None = None,
        tuned: Iterable[str],
    ) -> Study:
        """A new study; see ``Study.create``."""
        return await Study.create(
            self, name, trainer=trainer, dataset=dataset, model=model, seed=seed, values=values, tuned=tuned
        )

    async def load_study(self, study_id: str, *, tuned: Iterable[str] | None = None) -> Study:
        """An existing study of this token's owner; see ``Study.load``."""
        return await Study.load(self, study_id, tuned=tuned)

    async def list_studies(self) -> list[StudyInfo]:
        """The studies of this token's owner, oldest first."""
        resp = await self.call("ListStudies", pb.ListStudiesRequest(), idempotent=True)
        return [_study_info(s) for s in resp.studies]

    # -- plumbing ----------------------------------------------------------------------------------

    async def call(self, method: str, request: Any, *, idempotent: bool) -> Any:
        """One unary RPC, counted; idempotent calls are retried on retriable errors with backoff."""
        if self._closed:
            raise FailedPrecondition(f"{method}: the client is closed; open a new one with stagetree.connect()")
        fn = getattr(self.stub, method)
        attempts = self.retries if idempotent else 1
        first_failure = shed_since = 0.0
        i = 0
        while True:
            self.rpcs[method] += 1
            try:
                resp = await fn(request, metadata=self._metadata, timeout=self.timeout_s)
                self.reached = True
                return resp
            except grpc.RpcError as exc:
                shed_for = retry_after_s(exc)
                if shed_for is not None:
                    shed_since = shed_since or time.monotonic()
                    if time.monotonic() - shed_since < self.reconnect_s:
                        # shed before anything of it was done: any call may retry, after the time asked for
                        # (jittered, so that the shed clients do not come back together)
                        self.shed += 1
                        await asyncio.sleep(shed_for * (0.5 + random.random()))
                        continue
                err = error_of(exc, method, self.target)
                first_failure = first_failure or time.monotonic()
                i += 1
                safe = idempotent or never_sent(exc)  # a call the master never got may be sent again
                if not err.retriable or (
                    i >= (self.retries if safe else attempts) and not (safe and self.waits_for(err, first_failure))
                ):
                    raise err from exc
                delay = min(2.0, 0.05 * 2**i)
                log.info("retrying %s after %s", method, type(err).__name__, extra={"attempt": i})
                await asyncio.sleep(delay)

    def waits_for(self, err: StagetreeError, first_failure: float) -> bool:
        """Past its retries, whether a call failing since ``first_failure`` (``time.monotonic``) keeps
        trying: only while the master is unavailable after having answered, up to ``reconnect_s``."""
        return isinstance(err, Unavailable) and self.reached and time.monotonic() - first_failure < self.reconnect_s

    def stream(self, method: str, request: Any) -> Any:
        """Start one server-streaming RPC, counted; iterate the returned call."""
        if self._closed:
            raise FailedPrecondition(f"{method}: the client is closed; open a new one with stagetree.connect()")
        self.rpcs[method] += 1
        return getattr(self.stub, method)(request, metadata=self._metadata)


def connect(
    url: str | None = None,
    *,
    token: str | None = None,
    window_s: float = 0.002,
    max_batch: int = 1000,
    retries: int = 6,
    timeout_s: float = 60.0,
    reconnect_s: float = 120.0,
    tls: ClientTls | bool | None = None,
) -> Client:
    """A client for the master's gRPC API at ``url`` (``host:port`` or ``grpc://host:port``; default
    ``$STAGETREE_MASTER`` or ``127.0.0.1:50051``), authenticated by ``token`` (default ``$STAGETREE_TOKEN``).

    Use it as ``async with stagetree.connect(url, token=...) as client:``; nothing is sent until the
    first call. Must be called inside a running event loop.

    ``tls``: a ``ClientTls`` (``ca_file`` that signed the master's certificate, ``cert_file``/``key_file``
    for mutual TLS, ``server_name``), ``True`` (TLS with the system's roots), ``False`` (plaintext), or
    None: from ``$STAGETREE_TLS_CA_FILE``, ``_CERT_FILE``, ``_KEY_FILE``, ``_SERVER_NAME`` (plaintext when
    none is set, or with a ``grpcs://`` url TLS with the system's roots). ``token`` None: ``$STAGETREE_TOKEN``,
    else the content of the file ``$STAGETREE_TOKEN_FILE`` names (a mounted secret)."""
    raw = url if url is not None else os.environ.get(ENV_TARGET, DEFAULT_TARGET)
    secure_scheme = isinstance(raw, str) and raw.strip().startswith("grpcs://")
    target = parse_target(raw)
    if token is None:
        token = env_or_file(ENV_TOKEN) or None
    if tls is None:
        tls = ClientTls.from_env()
        if secure_scheme and not tls.on:
            tls = ClientTls(enabled=True)
    elif isinstance(tls, bool):
        tls = ClientTls(enabled=tls)
    elif not isinstance(tls, ClientTls):
        raise InvalidArgument(f"tls: must be a stagetree.ClientTls, True, False or None, got {tls!r}")
    return Client(
        target,
        token,
        window_s=window_s,
        max_batch=max_batch,
        retries=retries,
        timeout_s=timeout_s,
        reconnect_s=reconnect_s,
        tls=tls,
    )


def parse_target(url: str) -> str:
    """``host:port`` from ``host:port`` or ``grpc://host:port``; an HTTP URL is refused with the reason."""
    if not isinstance(url, str) or not url.strip():
        raise InvalidArgument(f"url: must be the master's gRPC address host:port, got {url!r}")
    url = url.strip()
    if url.startswith(("http://", "https://")):
        raise InvalidArgument(
            f"url: {url!r} is an HTTP URL; stagetree.connect() speaks gRPC: pass the master's gRPC address "
            f"host:port (default port 50051), and use the REST API at the HTTP one"
        )
    for scheme in ("grpc://", "grpcs://"):
        url = url.removeprefix(scheme)
    url = url.rstrip("/")
    if ":" not in url:
        raise InvalidArgument(f"url: {url!r} has no port; write host:port, e.g. 127.0.0.1:50051")
    return url


# ---------------------------------------------------------------------------------------------
# Study


def _check_tuned(tuned: Iterable[str] | None) -> tuple[str, ...] | None:
    if tuned is None:
        return None
    if isinstance(tuned, str):
        raise InvalidArgument(f"tuned: must be a list of hyper-parameter names, got the string {tuned!r}")
    names = tuple(sorted(set(tuned)))
    if not names or any(not isinstance(n, str) or not n for n in names):
        raise InvalidArgument(f"tuned: must be a non-empty list of hyper-parameter names, got {tuned!r}")
    return names


class Study:
    """A study on a master: a fixed part (trainer entry point, dataset, model, seed, fixed values) and the
    names of the tuned hyper-parameters. Every eval's config gives one sequence per tuned name.

    Studies whose fixed parts are equal share one search plan: an eval that another study (or this one)
    already trained is answered from stored metrics, and one that shares a prefix trains only from the
    latest checkpoint on that prefix.
    """

    def __init__(
        self, client: Client, info: StudyInfo, tuned: tuple[str, ...] | None, code_version: str | None = None
    ) -> None:
        self.client = client
        self.info = info
        self.tuned = tuned
        # the fixed part this object's evals carry when the caller's code differs from the study's own
        # (a study loaded by edited code): they go to that version's plan, never the old one's
        self._fixed_override: FixedPart | None = None
        if info.fixed is not None and code_version is not None and code_version != info.fixed.code_version:
            self._fixed_override = replace(info.fixed, code_version=code_version)
        self._buffer: list[Evaluation] = []
        self._flusher: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._sending = asyncio.Semaphore(4)
        self._by_request: dict[int, Evaluation] = {}  # sent, not finished: what the result stream follows
        self._watcher: asyncio.Task[None] | None = None
        self._watch_call: Any = None
        self._watch_ids: frozenset[int] = frozenset()
        self._widen = False
        self._completed: list[EvalResult] = []
        self._listeners: set[asyncio.Queue[EvalResult | None]] = set()
        client._studies.append(self)

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def fixed(self) -> FixedPart | None:
        """The fixed part this object's evals use: the study's, with this caller's code version."""
        return self._fixed_override or self.info.fixed

    @property
    def code_version(self) -> str:
        """The trainer code version this object's evals are trained with (and ``best`` looks at)."""
        fixed = self.fixed
        return fixed.code_version if fixed is not None else ""

    def __repr__(self) -> str:
        return f"Study(id={self.id!r}, name={self.name!r}, tuned={self.tuned!r})"

    @classmethod
    async def create(
        cls,
        client: Client,
        name: str,
        *,
        trainer: str,
        dataset: str = "",
        model: str = "",
        seed: int = 0,
        values: Mapping[str, Any] | None = None,
        code_version: str | None = None,
        code: Iterable[str | os.PathLike[str]] = (),
        load_if_exists: bool = False,
        tuned: Iterable[str],
        policies: Mapping[str, Any] | None = None,
        retry_user_errors: bool = False,
        curve_every_steps: int | None = None,
        curve_max_per_s: float | None = None,
    ) -> Study:
        """Create a study named ``name`` (unique per owner). ``trainer`` is the entry point of the user's
        ``Trainer`` (``"package.module:Class"``); ``values`` are fixed hyper-parameters; ``tuned`` names
        the hyper-parameters every eval gives a sequence for; ``policies`` picks scheduling policies by
        name (``{"time_share": "hermes", "placement": "wfd", "qos": "urgent", ...}``: see
        ``docs/policies.md``), validated by the master.

        Results are tied to the trainer's code: ``code_version`` defaults to a digest of the trainer's
        module source and of the files and directories in ``code`` (``client.codeversion``); an edit gives
        a new plan, so nothing computed by the old code is reused. Pass an explicit ``code_version`` (a
        git commit) when the trainer lives only on the cluster. With ``load_if_exists``, a study of that
        name that exists already is loaded instead (its fixed part is the one it was created with, except
        the code version): when this caller's code version differs from the one the study was created
        with, the loaded study's evals go to the plan of this caller's code, so no result or checkpoint of
        the old code is reused, and ``best`` looks at this code's results; the old results stay in the study,
        marked with their ``code_version``.

        An eval whose trainer raised fails at once with the traceback (``EvalFailed``): a retry would
        raise again. ``retry_user_errors`` retries those too (up to the master's attempt limit), for
        trainers whose failures are transient (a flaky data source).

        Learning curves (the step metrics ``train()`` returns or ``self.log`` reports) are kept every
        ``curve_every_steps`` steps (0: none) and at most ``curve_max_per_s`` points a second per batch
        (0: no limit); left out, the master's settings decide (a point a step, 20 a second)."""
        names = _check_tuned(tuned)
        curves = CurveSampling(  # checked here too, so a typo fails before anything is sent
            1 if curve_every_steps is None else curve_every_steps, 0.0 if curve_max_per_s is None else curve_max_per_s
        )
        if not isinstance(name, str) or not name.strip():
            raise InvalidArgument(f"name: must be a non-empty string, got {name!r}")
        check_trainer(trainer)
        if code_version is None:
            code_version = code_digest(trainer, code) if isinstance(trainer, str) else ""
            if code_version is None:
                log.warning(
                    "cannot find the trainer's module from this process: the study's results are not tied to "
                    "a code version; pass code_version= (e.g. your git commit) to tie them",
                    extra={"trainer": trainer},
                )
                code_version = ""
        fixed = FixedPart(
            trainer=trainer,
            dataset=dataset,
            model=model,
            seed=seed,
            values=dict(values or {}),
            code_version=code_version,
        )
        clash = sorted(set(fixed.values) & set(names or ()))
        if clash:
            raise InvalidArgument(f"{clash} are both fixed values and tuned; a hyper-parameter is one or the other")
        fixed_obj = fixed.to_json()
        if policies is not None:
            fixed_obj["policies"] = dict(policies)
        req = pb.CreateStudyRequest(
            name=name,
            fixed_json=json.dumps(fixed_obj, sort_keys=True),
            retry_user_errors=bool(retry_user_errors),
            curve_every_steps=None if curve_every_steps is None else curves.every_steps,
            curve_max_per_s=None if curve_max_per_s is None else float(curves.max_per_s),
        )
        try:
            return cls(client, _study_info(await client.call("CreateStudy", req, idempotent=False)), names)
        except AlreadyExists:
            if not load_if_exists:
                raise
        info = _study_info(await client.call("GetStudy", pb.GetStudyRequest(name=name), idempotent=True))
        study = cls(client, info, names, code_version)
        if info.fixed is not None and study._fixed_override is not None:
            log.warning(
                "study %r was created by trainer code %s and this run's code is %s: its evals train on a new plan "
                "for the new code (nothing the old code computed is reused); the old results stay in the study, "
                "marked with their code version",
                name,
                info.fixed.code_version or "(unversioned)",
                code_version or "(unversioned)",
                extra={"study_id": info.id},
            )
        return study

    @classmethod
    async def load(cls, client: Client, study: str, *, tuned: Iterable[str] | None = None) -> Study:
        """An existing study of the caller, by name or by id. The master does not keep the tuned names:
        pass ``tuned`` to have evals checked against them (otherwise any non-empty set of names is
        accepted)."""
        if not isinstance(study, str) or not study:
            raise InvalidArgument(f"study: must be a study's name or id, got {study!r}")
        try:
            info = await client.call("GetStudy", pb.GetStudyRequest(name=study), idempotent=True)
        except NotFound:
            if not _STUDY_ID.fullmatch(study):
                raise
            info = await client.call("GetStudy", pb.GetStudyRequest(study_id=study), idempotent=True)
        return cls(client, _study_info(info), _check_tuned(tuned))

    async def delete(self) -> int:
        """Delete the study: its live evals are cancelled, its requests deleted (returns how many). Its
        plans are kept, shared within the owner's scope; ``forget_plan`` first to drop what they hold."""
        r = await self.client.call("DeleteStudy", pb.DeleteStudyRequest(study_id=self.id), idempotent=True)
        return int(r.requests_deleted)

    async def stats(self, *, all_versions: bool = False) -> SharingStats:
        """What sharing bought this study: steps executed, unique and trial-by-trial, the merge rate,
        compute seconds used and saved, and the seconds its batches spent queued, starting up and on
        checkpoint I/O, apart from the compute (``stagetree.core.sharing``); over the requests of this
        object's trainer code version (a study loaded by edited code holds the old version's too), or over
        every request of the study with ``all_versions``."""
        one = not all_versions and self.fixed is not None
        req = pb.GetStudyStatsRequest(study_id=self.id, code_version=self.code_version if one else None)
        r = await self.client.call("GetStudyStats", req, idempotent=True)
        return SharingStats(
            dict(r.requests),
            r.steps_executed,
            r.unique_steps,
            r.trial_by_trial_steps,
            r.compute_seconds,
            queue_seconds=r.queue_seconds,
            startup_seconds=r.startup_seconds,
            checkpoint_seconds=r.checkpoint_seconds,
        )

    async def forget_plan(self, plan_key: str = "") -> dict[str, int]:
        """Drop the plan's checkpoints and metrics (and the finished requests they answered): ``{"checkpoints",
        "bytes_freed", "metrics", "requests"}``. Refused while a request on it is live."""
        req = pb.ForgetPlanRequest(study_id=self.id, plan_key=plan_key)
        r = await self.client.call("ForgetPlan", req, idempotent=True)
        return {
            "checkpoints": r.checkpoints,
            "bytes_freed": r.bytes_freed,
            "metrics": r.metrics,
            "requests": r.requests,
        }

    # -- evals -------------------------------------------------------------------------------------

    def validate(self, config: Mapping[str, Any], step: int) -> tuple[dict[str, Sequence], str, int]:
        """The config as sequences, its JSON for the wire, and the step; raises what the master would."""
        step = check_step(step)
        if not isinstance(config, Mapping) or not config:
            raise InvalidArgument(
                f"config: must be a non-empty mapping of hyper-parameter name to sequence, got {config!r}"
            )
        Config.of(config)  # the master's own canonicalization: a bad sequence fails here
        seqs = {name: as_sequence(v, field=name) for name, v in config.items()}
        if self.tuned is not None and tuple(sorted(seqs)) != self.tuned:
            missing = sorted(set(self.tuned) - set(seqs))
            extra = sorted(set(seqs) - set(self.tuned))
            raise InvalidArgument(
                f"config: study {self.name!r} tunes {list(self.tuned)}; missing {missing}, unexpected {extra}"
            )
        if self.fixed is not None:
            clash = sorted(set(seqs) & set(self.fixed.values))
            if clash:
                raise InvalidArgument(f"config: {clash} are fixed values of study {self.name!r}; they cannot be tuned")
        obj: dict[str, Any] = {"tuned": {n: s.to_json() for n, s in sorted(seqs.items())}}
        if self._fixed_override is not None:
            obj["fixed"] = self._fixed_override.to_json()
        text = json.dumps(obj, separators=(",", ":"))
        if len(text) > MAX_CONFIG_BYTES:
            raise InvalidArgument(f"config: {len(text)} bytes of JSON is over the {MAX_CONFIG_BYTES}-byte limit")
        return seqs, text, step

    def submit(self, config: Mapping[str, Any], step: int, *, label: str = "") -> Evaluation:
        """Queue an eval of ``config`` at ``step`` and return its handle at once (no I/O here: the eval
        goes out with the others of the same batch). ``label`` names the trial it belongs to (the tuners
        pass ``trial-<id>``): REST and the CLI show it, and the study's stats count a trial once.
        Raises ``InvalidArgument`` for a bad config."""
        if self.client._closed:
            raise FailedPrecondition("submit: the client is closed; open a new one with stagetree.connect()")
        if not isinstance(label, str) or len(label) > 128:
            raise InvalidArgument(f"label: must be a string of at most 128 characters, got {label!r}")
        seqs, text, step = self.validate(config, step)
        ev = Evaluation(self, seqs, text, step, label)
        self._buffer.append(ev)
        if self._flusher is None or self._flusher.done():
            self._flusher = self._spawn(self._flush())
        return ev

    async def eval(self, config: Mapping[str, Any], step: int, *, label: str = "") -> dict[str, float]:
        """Train ``config`` up to ``step`` (or reuse what is stored) and return the metrics there.

        Concurrent calls are batched into one RPC. Raises ``EvalFailed``, ``EvalCancelled``, or the
        error of the RPC (``Unavailable`` after retries, ...)."""
        return await self.submit(config, step, label=label)

    async def cancel(self, evaluation: Evaluation | int) -> EvalResult | None:
        """Cancel an eval (its handle, or a request id of this study). The eval raises ``EvalCancelled``;
        the batch serving it is aborted only when no other request needs it. Returns the request's
        state after the call (``None`` when it never reached the master)."""
        if isinstance(evaluation, Evaluation):
            if evaluation.request_id is None:
                if evaluation in self._buffer:
                    self._buffer.remove(evaluation)
                evaluation._fail(EvalCancelled(f"eval {evaluation.client_request_id} was cancelled before it was sent"))
                return None
            rid = evaluation.request_id
        elif isinstance(evaluation, int) and not isinstance(evaluation, bool):
            rid = evaluation
        else:
            raise InvalidArgument(f"cancel: expects an Evaluation or a request id, got {evaluation!r}")
        r = await self.client.call(
            "CancelRequest", pb.CancelRequestRequest(study_id=self.id, request_id=rid), idempotent=True
        )
        return self._deliver(r) or self._result_of(r)

    async def results(self, *, replay: bool = False) -> AsyncIterator[EvalResult]:
        """Finished evals of this study submitted through this object, as they finish (DONE, FAILED and
        CANCELLED alike); with ``replay``, first those finished before the call. Ends when the client closes."""
        q: asyncio.Queue[EvalResult | None] = asyncio.Queue()
        if replay:
            for r in self._completed:
                q.put_nowait(r)
        self._listeners.add(q)
        try:
            while True:
                item = await q.get()
                if item is None:
                    return
                yield item
        finally:
            self._listeners.discard(q)

    async def best(
        self, metric: str, mode: str = "max", *, scope: str = "completed", all_versions: bool = False
    ) -> EvalResult | None:
        """The study's best finished eval by ``metric`` (``mode`` "max" or "min"), ties to the earliest; None
        when none reported it. Asks the master (``ListRequests``), so it covers every request of the study,
        also on a loaded study; the config comes from the plan when another client submitted it.

        ``scope="completed"`` (the default) compares the trials that reached the study's last step (the
        furthest step of its finished evals: ASHA's top rung once a trial got there), as Optuna's
        ``best_trial`` compares completed trials; ``scope="any"`` compares every finished eval at any
        step, so a trial stopped at a lower rung may win (Ray Tune's ``scope="all"``). Only the results of
        this object's trainer code version count, unless ``all_versions``."""
        if mode not in ("max", "min"):
            raise InvalidArgument(f"mode: must be 'max' or 'min', got {mode!r}")
        if scope not in ("completed", "any"):
            raise InvalidArgument(f"scope: must be 'completed' or 'any', got {scope!r}")
        resp = await self.client.call("ListRequests", pb.ListRequestsRequest(study_id=self.id), idempotent=True)
        one = not all_versions and self.fixed is not None
        mine = [r for r in resp.results if not one or r.code_version == self.code_version]
        last = max((r.step for r in mine if _state_name(r.state) == "DONE"), default=0)
        best: pb.RequestResult | None = None
        key = -math.inf
        for r in mine:
            v = r.metrics.get(metric)
            if _state_name(r.state) != "DONE" or v is None or math.isnan(v) or (scope == "completed" and r.step < last):
                continue
            k = v if mode == "max" else -v
            if best is None or k > key:
                best, key = r, k
        if best is None:
            return None
        known = next((c for c in self._completed if c.request_id == best.request_id and c.config), None)
        if known is not None:
            return replace(known, code_version=best.code_version, plan_key=best.plan_key)
        return replace(self._result_of(best), config=await self._config_at(best.node, best.plan_key))

    async def _config_at(self, node: int, plan_key: str = "") -> dict[str, Sequence] | None:
        """The config of a plan node (as the families that build its schedules), from the plan ``plan_key``
        (default: the one this study uses)."""
        try:
            plan = await self.plan(plan_key)
        except InvalidArgument:  # several plans and none named: the node is in one of them
            return None
        for n in plan["nodes"]:
            if n["id"] == node:
                cfg = Config.from_json(n["segments"])
                return {name: cfg.sequence(name) for name in cfg.names()}
        return None

    async def metrics(self, config: Mapping[str, Any], step: int) -> dict[str, float] | None:
        """Stored metrics of ``config`` at ``step`` (from any study sharing the plan), or None; never
        creates a request."""
        _, text, step = self.validate(config, step)
        r = await self.client.call(
            "GetMetrics", pb.GetMetricsRequest(study_id=self.id, config_json=text, step=step), idempotent=True
        )
        return dict(r.metrics) if r.found else None

    async def curve(
        self, request_id: int, *, start: int = 0, end: int | None = None, max_points: int = 0
    ) -> list[tuple[int, dict[str, float]]]:
        """The learning curve of a request (an ``EvalResult.request_id``): ``[(step, {name: value}), ...]``
        over steps ``[start, end]`` (up to the request's step by default), its shared prefix's points
        then its own; thinned on the master to ``max_points`` (0: every point)."""
        req = pb.GetCurveRequest(
            study_id=self.id,
            request_id=request_id,
            start=start,
            end=end or 0,
            has_end=end is not None,
            max_points=max_points,
        )
        r = await self.client.call("GetCurve", req, idempotent=True)
        return [(int(p.step), dict(p.values)) for p in r.points]

    async def logs(self, request_id: int) -> list[TrainerLine]:
        """The text lines the trainer logged (``self.log_text``) in every batch attempt that trained a
        request (an ``EvalResult.request_id``), in the order they ran; a batch attempt keeps at most 200
        lines of at most 1,000 characters (docs/trainers.md)."""
        r = await self.client.call(
            "GetRequestLog", pb.GetRequestLogRequest(study_id=self.id, request_id=request_id), idempotent=True
        )
        return [
            TrainerLine(int(x.batch_id), int(x.attempt), int(x.seq), int(x.node), int(x.step), float(x.at), x.line)
            for x in r.lines
        ]

    async def plan(self, plan_key: str = "") -> dict[str, Any]:
        """The search plan this study uses, in the REST API's JSON shape: ``{"key", "fixed", "nodes": [{"id",
        "parent", "start", "config", "segments", "requests", "checkpoint_steps", "metric_steps"}]}``; a node's
        ``config`` is in the family form (``core.seqforms``), ``segments`` its canonical segments."""
        p = await self.client.call("GetPlan", pb.GetPlanRequest(study_id=self.id, plan_key=plan_key), idempotent=True)
        return {
            "key": p.key,
            "fixed": json.loads(p.fixed_json) if p.fixed_json else None,
            "nodes": [
                {
                    "id": n.id,
                    "parent": n.parent or None,
                    "start": n.start,
                    "config": config_family_json(json.loads(n.config_json)),
                    "segments": json.loads(n.config_json),
                    "requests": dict(n.requests),
                    "checkpoint_steps": list(n.checkpoint_steps),
                    "metric_steps": list(n.metric_steps),
                }
                for n in p.nodes
            ],
        }

    # -- batching ----------------------------------------------------------------------------------

    def _spawn(self, coro: Awaitable[T]) -> asyncio.Task[T]:
        task: asyncio.Task[T] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _flush(self) -> None:
        await asyncio.sleep(0)  # let every coroutine ready in this tick add its eval
        if self.client.window_s:
            await asyncio.sleep(self.client.window_s)
        while self._buffer:
            n = self.client.max_batch
            chunk, self._buffer = self._buffer[:n], self._buffer[n:]
            chunk = [e for e in chunk if not e.done()]
            if chunk:
                self._spawn(self._send(chunk))

    async def _send(self, chunk: list[Evaluation]) -> None:
        async with self._sending:
            await self._submit(chunk)

    async def _submit(self, chunk: list[Evaluation]) -> None:
        chunk = [e for e in chunk if not e.done()]
        if not chunk:
            return
        req = pb.SubmitRequestsRequest(
            study_id=self.id,
            items=[
                pb.SubmitItem(
                    client_request_id=e.client_request_id, config_json=e.config_json, step=e.step, label=e.label
                )
                for e in chunk
            ],
        )
        try:
            resp = await self.client.call("SubmitRequests", req, idempotent=True)
        except ResourceExhausted as exc:
            if len(chunk) == 1:
                chunk[0]._fail(exc)
                return
            # the master's batch limit is below ours: learn it and resend in pieces (ids make it safe)
            m = re.search(r"limit of (\d+)", exc.message)
            limit = int(m.group(1)) if m else len(chunk) // 2
            self.client.max_batch = max(1, min(self.client.max_batch, limit))
            log.info("batch limit lowered to %d", self.client.max_batch, extra={"study_id": self.id})
            for i in range(0, len(chunk), self.client.max_batch):
                await self._submit(chunk[i : i + self.client.max_batch])
            return
        except InvalidArgument as exc:
            await self._isolate(chunk, exc)
            return
        except StagetreeError as exc:
            for e in chunk:
                e._fail(exc)
            return
        for e, r in zip(chunk, resp.results, strict=True):
            e.request_id = r.request_id
            self._by_request[r.request_id] = e
            if _state_name(r.state) in TERMINAL:
                self._deliver(r)
        self._follow()

    async def _isolate(self, chunk: list[Evaluation], exc: InvalidArgument) -> None:
        """One bad item must not fail the evals batched with it: fail the item the master named (or
        bisect when it named none) and resend the others."""
        if len(chunk) == 1:
            chunk[0]._fail(exc)
            return
        m = re.match(r"items\[(\d+)\]", exc.message)
        if m and int(m.group(1)) < len(chunk):
            bad = int(m.group(1))
            chunk[bad]._fail(InvalidArgument(exc.message.replace(f"items[{bad}]", "", 1).lstrip(".: ") or exc.message))
            await self._submit(chunk[:bad] + chunk[bad + 1 :])
            return
        half = len(chunk) // 2
        await self._submit(chunk[:half])
        await self._submit(chunk[half:])

    def _follow(self) -> None:
        """Make the study's one result stream cover every outstanding request: start it, or restart it
        wider when new requests are not on it (results that finish meanwhile come on the new one)."""
        if not self._by_request or self.client._closed:
            return
        if self._watcher is None or self._watcher.done():
            self._watcher = self._spawn(self._watch())
        elif self._watch_call is not None and not self._by_request.keys() <= self._watch_ids:
            self._widen = True
            self._watch_call.cancel()

    async def _watch(self) -> None:
        """Follow the outstanding requests on one ``StreamResults`` until each finished."""
        attempt = 0
        first_failure = 0.0  # of the current run of failures (time.monotonic)
        while self._by_request and not self.client._closed:
            ids = sorted(self._by_request)
            call = self.client.stream("StreamResults", pb.StreamResultsRequest(study_id=self.id, request_ids=ids))
            self._watch_call, self._watch_ids, self._widen = call, frozenset(ids), False
            try:
                async for r in call:
                    self._deliver(r)
                    attempt, first_failure = 0, 0.0
                    self.client.reached = True
                if any(rid in self._by_request for rid in ids):  # ended early: reopen, but not in a busy loop
                    attempt += 1
                    await asyncio.sleep(min(2.0, 0.05 * 2**attempt))
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if self._widen and task is not None and not task.cancelling():
                    continue  # we cancelled the call to follow more requests
                call.cancel()
                raise
            except grpc.RpcError as exc:
                if self.client._closed:
                    return
                if self._widen and exc.code() == grpc.StatusCode.CANCELLED:
                    continue
                err = error_of(exc, "StreamResults", self.client.target)
                attempt += 1
                first_failure = first_failure or time.monotonic()
                if not err.retriable or (
                    attempt >= self.client.retries and not self.client.waits_for(err, first_failure)
                ):
                    for rid in ids:
                        e = self._by_request.pop(rid, None)
                        if e is not None:
                            e._fail(err)
                    continue
                await asyncio.sleep(min(2.0, 0.05 * 2**attempt))
            finally:
                self._watch_call = None

    def _result_of(self, r: pb.RequestResult) -> EvalResult:
        return EvalResult(
            r.request_id,
            r.client_request_id,
            _state_name(r.state),
            r.step,
            r.node,
            dict(r.metrics),
            None,
            r.error,
            r.label,
            r.code_version,
            r.plan_key,
        )

    def _deliver(self, r: pb.RequestResult) -> EvalResult | None:
        """Complete the eval of a finished request and tell ``results()`` listeners (once per request)."""
        if _state_name(r.state) not in TERMINAL:
            return None
        e = self._by_request.pop(r.request_id, None)
        if e is None:
            return None
        res = e._finish(r) or EvalResult(
            r.request_id,
            r.client_request_id,
            _state_name(r.state),
            r.step,
            r.node,
            dict(r.metrics),
            e.config,
            getattr(r, "error", ""),
            code_version=self.code_version,
        )
        self._completed.append(res)
        for q in self._listeners:
            q.put_nowait(res)
        return res

    def _abandon(self, e: Evaluation) -> None:
        """The task awaiting ``e`` was cancelled: drop it from the batch, or cancel its request."""
        if e in self._buffer:
            self._buffer.remove(e)
        if e.request_id is not None and e.request_id in self._by_request and not self.client._closed:
            rid = e.request_id

            async def cancel() -> None:
                with contextlib.suppress(StagetreeError):
                    await self.cancel(rid)

            self._spawn(cancel())

    async def _close(self) -> None:
        for e in list(self._buffer) + list(self._by_request.values()):
            e._fail(Unavailable("the client was closed before this eval finished; evaluate it again on a new client"))
        self._buffer.clear()
        self._by_request.clear()
        for q in self._listeners:
            q.put_nowait(None)
        tasks = [t for t in self._tasks if not t.done()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
