"""CLI formatting and command dispatch, with canned REST answers (no server)."""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest

from stagetree.client import cli
from stagetree.core import errors as e
from stagetree.core.config import Config
from stagetree.core.seqforms import config_family_json
from stagetree.core.sequences import Cosine, MultiStep, Warmup

FIXED = {"trainer": "pkg.train:Net", "dataset": "cifar10", "model": "resnet20", "seed": 0, "values": {"wd": 0.0005}}
STUDY = {"id": "abc123", "name": "sweep", "owner": "alice", "fixed": FIXED, "created_at": 1_700_000_000.0}


def _req(rid: int, state: str, step: int, node: int, **metrics: float) -> dict[str, Any]:
    return {
        "request_id": rid,
        "client_request_id": f"c{rid}",
        "state": state,
        "metrics": metrics or None,
        "node": node,
        "step": step,
    }


REQUESTS = [
    _req(1, "DONE", 10, 1, acc=0.5, loss=0.5),
    _req(2, "DONE", 20, 2, acc=0.7, loss=0.3),
    _req(3, "DONE", 20, 3, acc=0.7, loss=0.31),
    _req(4, "NOT_SCHED", 40, 3),
    _req(5, "FAILED", 40, 2),
]

ROOT = Config.of({"lr": MultiStep(0.1, [10], 0.1), "bs": 32}).to_json()
CHILD = Config.of({"lr": MultiStep(0.1, [10], 0.5), "bs": 32}).to_json()
GRAND = Config.of({"lr": Warmup(0.0, 5, Cosine(0.1, 0.0, 20)), "bs": 32}).to_json()
CHILD_FAMILIES = {"bs": 32, "lr": {"kind": "multistep", "init": 0.1, "milestones": [10], "gamma": 0.5}}
PLAN = {
    "key": "k1",
    "fixed": FIXED,
    "nodes": [
        {
            "id": 1,
            "parent": None,
            "start": 0,
            "config": config_family_json(ROOT),
            "segments": ROOT,
            "requests": {"DONE": 1},
            "checkpoint_steps": [10, 20],
            "metric_steps": [10],
        },
        {
            "id": 2,
            "parent": 1,
            "start": 10,
            "config": config_family_json(CHILD),
            "segments": CHILD,
            "requests": {"DONE": 1, "FAILED": 1},
            "checkpoint_steps": [],
            "metric_steps": [20],
        },
        {
            "id": 3,
            "parent": None,
            "start": 0,
            "config": config_family_json(GRAND),
            "segments": GRAND,
            "requests": {"DONE": 1, "NOT_SCHED": 1},
            "checkpoint_steps": [],
            "metric_steps": [20],
        },
    ],
}
NODES = [
    {
        "node_manager_id": "nm-1",
        "address": "h1",
        "state": "ALIVE",
        "last_heartbeat": 995.0,
        "slots": [
            {"id": "g0", "gpu_type": "NVIDIA H100"},
            {"id": "g1", "gpu_type": "NVIDIA H100"},
            {"id": "c0", "gpu_type": "cpu"},
        ],
    },
]


class FakeRest:
    def __init__(self) -> None:
        self.paths: list[str] = []

    def get(self, path: str, **query: Any) -> Any:
        self.paths.append(path)
        if path == "/studies":
            return [STUDY]
        if path == "/hosts":
            return NODES
        if path.endswith("/plan"):
            return PLAN
        if path.endswith("/requests"):
            return REQUESTS
        if path == "/studies/abc123":
            return STUDY
        raise e.NotFound(f"study {path!r} does not exist")


def _run(argv: list[str]) -> tuple[Any, str, int]:
    ns = cli._parser().parse_args(argv)
    return cli.run(ns, FakeRest())  # type: ignore[arg-type]


def test_describe_sequences() -> None:
    assert cli.describe_config(ROOT) == "bs=32 lr=0.1, @10 0.01"
    assert cli.describe_config(CHILD, start=10) == "bs=32 lr=0.05"
    assert cli.describe_config(GRAND) == "bs=32 lr=linear(0, 0.02/step), @5 cosine(0.1->0, period 20, x1)"
    assert cli.describe_sequence(ROOT["lr"], 0, until=10) == "0.1"


def test_study_list_and_show() -> None:
    doc, text, status = _run(["study", "list"])
    assert status == 0 and doc == [STUDY]
    header, row = text.splitlines()
    assert header.split() == ["ID", "NAME", "OWNER", "CREATED", "TRAINER"]
    assert row.startswith("abc123  sweep") and row.endswith("pkg.train:Net")
    doc, text, status = _run(["study", "show", "abc123"])
    assert doc["requests"] == {"total": 5, "by_state": {"DONE": 3, "FAILED": 1, "NOT_SCHED": 1}}
    assert doc["metrics"] == ["acc", "loss"] and doc["max_step"] == 40
    assert "requests  5 (DONE 3, FAILED 1, NOT_SCHED 1)" in text and "trainer   pkg.train:Net" in text


def test_study_best_ties_go_to_the_lower_request_and_show_the_config() -> None:
    doc, text, status = _run(["study", "best", "abc123", "--metric", "acc"])
    assert status == 0 and doc["request"]["request_id"] == 2 and doc["config"] == CHILD_FAMILIES
    assert text.splitlines()[0] == "best acc (max): 0.7"
    assert "config    bs=32 lr=MultiStep(0.1, [10], 0.5)" in text.splitlines()
    doc, _, _ = _run(["study", "best", "abc123", "--metric", "loss", "--mode", "min"])
    assert doc["request"]["request_id"] == 2
    doc, text, status = _run(["study", "best", "abc123", "--metric", "bleu"])
    assert status == 1 and doc["request"] is None and "bleu" in text


def test_plan_show_draws_the_tree() -> None:
    doc, text, status = _run(["plan", "show", "abc123"])
    assert status == 0 and doc == PLAN
    lines = text.splitlines()
    assert lines[0].startswith("plan k1  trainer=pkg.train:Net dataset=cifar10 model=resnet20 seed=0")
    assert lines[1] == "3 nodes; requests: DONE 3, FAILED 1, NOT_SCHED 1"
    assert lines[2] == "#1 @0 bs=32 lr=MultiStep(0.1, [10], 0.1)  |  req DONE:1  |  ckpt 10,20  |  metrics 10"
    assert lines[3] == "└─ #2 @10 lr=MultiStep(0.1, [10], 0.5)  |  req DONE:1 FAILED:1  |  metrics 20"
    assert lines[4].startswith("#3 @0 bs=32 lr=Warmup(0.0, 5, then=Cosine(0.1, 0.0, 20))  |")


def test_nodes_table() -> None:
    header, row = cli.format_hosts(NODES, now=1000.0).splitlines()
    assert header.split("  ")[0] == "NODE MANAGER"
    assert row.split() == ["nm-1", "ALIVE", "5s", "ago", "3", "2x", "NVIDIA", "H100,", "1x", "cpu"]
    assert cli.format_hosts([]) == "no node managers registered"


def test_http_errors_map_to_the_error_tree() -> None:
    err = cli.http_error(401, json.dumps({"error": "UNAUTHENTICATED", "message": "unknown bearer token"}).encode())
    assert isinstance(err, e.Unauthenticated) and "--token" in err.message
    err = cli.http_error(404, json.dumps({"error": "NOT_FOUND", "message": "study 'x' does not exist"}).encode())
    assert isinstance(err, e.NotFound)
    err = cli.http_error(422, json.dumps({"detail": [{"loc": ["body", "name"], "msg": "missing"}]}).encode())
    assert isinstance(err, e.InvalidArgument) and "missing" in err.message
    assert type(cli.http_error(502, b"<html>")) is e.StagetreeError


def test_main_prints_json_and_errors(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "RestClient", lambda url, token, **_: FakeRest())
    assert cli.main(["study", "list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == [STUDY]
    assert cli.main(["study", "show", "nope"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "no study with the id or name 'nope'" in captured.err
    assert cli.main(["study", "show", "nope", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["error"] == "NOT_FOUND"
    assert cli.main(["study"]) == 2  # argparse usage error


def test_unreachable_master_says_what_to_do() -> None:
    rest = cli.RestClient("http://127.0.0.1:1/api/v1", "t", timeout_s=2)
    assert rest.url == "http://127.0.0.1:1"
    with pytest.raises(e.Unavailable, match="STAGETREE_URL"):
        rest.get("/studies")
    with pytest.raises(e.InvalidArgument):
        cli.RestClient("127.0.0.1:8080", None)


def test_dispatch_from_the_main_cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from stagetree import cli as main_cli

    monkeypatch.setattr(cli, "RestClient", lambda url, token, **_: FakeRest())
    assert main_cli.main(["plan", "show", "abc123"]) == 0
    assert capsys.readouterr().out.startswith("plan k1")
    assert main_cli.main(["hosts", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == NODES
    assert isinstance(cli._parser().parse_args(["hosts"]), argparse.Namespace)
    assert main_cli.main(["nodes", "--json"]) == 0  # the deprecated name: the same answer, and a warning
    out = capsys.readouterr()
    assert json.loads(out.out) == NODES and "deprecated" in out.err and "stagetree hosts" in out.err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    from stagetree import cli as main_cli

    assert main_cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"stagetree {version('stagetree')}"


def test_a_429_is_waited_out_as_its_retry_after_says() -> None:
    assert cli.retry_after_s("2", b"") == 2.0
    assert cli.retry_after_s(None, b'{"retry_after_s": 0.5}') == 0.5
    assert cli.retry_after_s("Thu, 01 Jan 1970 00:00:00 GMT", b"") == 0.0  # a date in the past: now
    assert cli.retry_after_s("soon", b"not json") == 1.0
    assert cli.retry_after_s("86400", b"") == cli.MAX_RETRY_AFTER_S
