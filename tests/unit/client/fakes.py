"""An in-memory stand-in for the master's gRPC stub, for unit tests of the SDK and the driver.

``FakeMaster`` answers ``SubmitRequests`` (idempotent per client request id, like the master), serves
``StreamResults`` from per-request completions, and records every call. By default a request finishes
as soon as a stream asks for it, with ``metrics_of(config, step)``; ``hold`` keeps requests pending until
``finish`` is called, ``failing`` marks client request ids whose work fails, and ``errors`` queues gRPC
errors for the next calls of a method.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from stagetree.client.sdk import Client
from stagetree.core.config import Config
from stagetree.proto.stagetree.v1 import master_pb2 as pb


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def fake_metrics(config: Config, step: int) -> dict[str, float]:
    lr = float(config.values_at(max(step - 1, 0)).get("lr", 0.0))  # type: ignore[arg-type]
    return {"acc": round((1 - math.exp(-step / 10)) / (1 + (lr - 0.03) ** 2 * 1000), 6)}


class _Stream:
    def __init__(self, master: FakeMaster, wanted: set[int]) -> None:
        self.master = master
        self.wanted = wanted
        self.cancelled = False

    def __aiter__(self) -> AsyncIterator[pb.RequestResult]:
        return self._gen()

    async def _gen(self) -> AsyncIterator[pb.RequestResult]:
        m = self.master
        m._raise_queued("StreamResults")
        while self.wanted:
            if self.cancelled:
                raise asyncio.CancelledError
            if not m.hold:
                m.finish(sorted(self.wanted))
            for rid in sorted(self.wanted):
                if rid in m._finished:
                    self.wanted.discard(rid)
                    yield m._finished[rid]
            if self.wanted:
                m._changed.clear()
                await m._changed.wait()

    def cancel(self) -> bool:
        self.cancelled = True
        self.master._changed.set()
        return True


class FakeMaster:
    def __init__(self, metrics_of: Callable[[Config, int], dict[str, float]] = fake_metrics) -> None:
        self.metrics_of = metrics_of
        self.calls: dict[str, list[Any]] = defaultdict(list)
        self.errors: dict[str, list[grpc.RpcError]] = defaultdict(list)
        self.max_items: int | None = None
        self.bad_items: set[str] = set()  # client request ids the master rejects as invalid
        self.failing: set[str] = set()  # client request ids whose work fails
        self.hold = False
        self.done_now: set[str] = set()  # client request ids answered DONE by SubmitRequests itself
        self.fail_if: Callable[[Config, int], bool] = lambda _c, _s: False  # whose work fails, by config
        self.stuck_if: Callable[[Config, int], bool] = lambda _c, _s: False  # whose work never finishes
        self._by_client: dict[str, pb.RequestResult] = {}
        self._configs: dict[int, tuple[Config, int]] = {}
        self._finished: dict[int, pb.RequestResult] = {}
        self._changed = asyncio.Event()
        self._next_id = 1

    def _raise_queued(self, method: str) -> None:
        if self.errors[method]:
            raise self.errors[method].pop(0)

    async def CreateStudy(self, request: pb.CreateStudyRequest, **_: Any) -> pb.Study:
        self.calls["CreateStudy"].append(request)
        self._raise_queued("CreateStudy")
        return pb.Study(id="study-1", name=request.name, owner="alice", fixed_json=request.fixed_json, created_at=1.0)

    async def GetStudy(self, request: pb.GetStudyRequest, **_: Any) -> pb.Study:
        self.calls["GetStudy"].append(request)
        self._raise_queued("GetStudy")
        fixed = json.dumps({"trainer": "m:T", "dataset": "", "model": "", "seed": 0, "values": {}})
        sid, name = request.study_id or "study-1", request.name or "loaded"
        return pb.Study(id=sid, name=name, owner="alice", fixed_json=fixed, created_at=1.0)

    async def SubmitRequests(self, request: pb.SubmitRequestsRequest, **_: Any) -> pb.SubmitRequestsResponse:
        self.calls["SubmitRequests"].append(request)
        self._raise_queued("SubmitRequests")
        if self.max_items is not None and len(request.items) > self.max_items:
            raise FakeRpcError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"submit: {len(request.items)} items is over the limit of {self.max_items}; split the batch",
            )
        for i, it in enumerate(request.items):
            if it.client_request_id in self.bad_items:
                raise FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, f"items[{i}].config: rejected by the fake")
        out = []
        for it in request.items:
            known = self._by_client.get(it.client_request_id)
            if known is None:
                rid = self._next_id
                self._next_id += 1
                config = Config.of(json.loads(it.config_json)["tuned"])
                self._configs[rid] = (config, it.step)
                known = pb.RequestResult(
                    request_id=rid, client_request_id=it.client_request_id, state=pb.NOT_SCHED, node=1, step=it.step
                )
                if it.client_request_id in self.done_now:
                    known = self._result(rid, it.client_request_id)
                    self._finished[rid] = known
                self._by_client[it.client_request_id] = known
            out.append(known)
        return pb.SubmitRequestsResponse(results=out)

    def _result(self, rid: int, cid: str) -> pb.RequestResult:
        config, step = self._configs[rid]
        if cid in self.failing or self.fail_if(config, step):
            return pb.RequestResult(
                request_id=rid, client_request_id=cid, state=pb.FAILED, node=1, step=step, error="boom"
            )
        return pb.RequestResult(
            request_id=rid,
            client_request_id=cid,
            state=pb.DONE,
            node=1,
            step=step,
            metrics=self.metrics_of(config, step),
        )

    def finish(self, rids: list[int] | None = None) -> None:
        """Finish held requests (all of them by default)."""
        for cid, r in self._by_client.items():
            if (rids is None or r.request_id in rids) and r.request_id not in self._finished:
                if self.stuck_if(*self._configs[r.request_id]):
                    continue
                self._finished[r.request_id] = self._result(r.request_id, cid)
        self._changed.set()

    async def CancelRequest(self, request: pb.CancelRequestRequest, **_: Any) -> pb.RequestResult:
        self.calls["CancelRequest"].append(request)
        self._raise_queued("CancelRequest")
        rid = request.request_id
        cid = next(c for c, r in self._by_client.items() if r.request_id == rid)
        if rid not in self._finished:
            self._finished[rid] = pb.RequestResult(
                request_id=rid, client_request_id=cid, state=pb.CANCELLED, node=1, step=self._configs[rid][1]
            )
            self._changed.set()
        return self._finished[rid]

    async def ListRequests(self, request: pb.ListRequestsRequest, **_: Any) -> pb.ListRequestsResponse:
        self.calls["ListRequests"].append(request)
        self._raise_queued("ListRequests")
        known = sorted(self._by_client.values(), key=lambda r: r.request_id)
        return pb.ListRequestsResponse(results=[self._finished.get(r.request_id, r) for r in known])

    def StreamResults(self, request: pb.StreamResultsRequest, **_: Any) -> _Stream:
        self.calls["StreamResults"].append(request)
        return _Stream(self, set(request.request_ids))


def fake_client(master: FakeMaster, **kwargs: Any) -> Client:
    """A client whose stub is ``master`` (its channel points nowhere and is never used)."""
    client = Client("127.0.0.1:1", "alice-token", **kwargs)
    client.stub = master  # type: ignore[assignment]
    return client
