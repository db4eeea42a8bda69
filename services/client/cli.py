"""The client commands of the ``stagetree`` CLI: ``study list|show|best``, ``plan show``, ``hosts``.

They talk to the master's REST API (``--url``, default ``$STAGETREE_URL`` or ``http://127.0.0.1:8080``)
with a bearer token (``--token`` or ``--token-file``, default ``$STAGETREE_TOKEN`` or the file
``$STAGETREE_TOKEN_FILE`` names) over http or https (``--ca-file``, default ``$STAGETREE_TLS_CA_FILE``,
verifies the master's certificate), using only the standard library, and
print text for people or, with ``--json``, one JSON document for scripts. ``main(argv)`` is dispatched
from ``stagetree.cli`` with the command word first (``["study", "list"]``, ``["plan", "show", ID]``,
``["hosts"]``; ``nodes`` is a deprecated alias of ``hosts``); it prints and returns an exit status (0 ok,
1 an error, 2 bad usage) instead of raising.

The formatting functions are pure (plain JSON in, text out) so they are unit-tested without a server.
"""

from __future__ import annotations

import argparse
import email.utils
import json
import math
import os
import ssl
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from stagetree.core.errors import ALL_ERRORS, InvalidArgument, NotFound, StagetreeError, Unavailable
from stagetree.core.seqforms import config_text
from stagetree.filevars import env_or_file, read_secret_file
from stagetree.tls import ENV_CLIENT_PREFIX, ClientTls

ENV_URL = "STAGETREE_URL"
ENV_TOKEN = "STAGETREE_TOKEN"
DEFAULT_URL = "http://127.0.0.1:8080"
API = "/api/v1"
MAX_TRIALS_SHOWN = 20
RETRIES_429 = 8  # a master at its admission limit refused the call before doing anything: send it again
MAX_RETRY_AFTER_S = 30.0
_ERRORS: dict[str, type[StagetreeError]] = {cls.code: cls for cls in reversed(ALL_ERRORS)}

# ---------------------------------------------------------------------------------------------
# REST


class RestClient:
    """A minimal JSON client of the master's REST API (``urllib``; no dependency). A call the master
    sheds at its admission limit (429) did nothing there: it is sent again after the ``Retry-After``
    the answer gives, up to ``RETRIES_429`` times, whatever its method."""

    def __init__(
        self, url: str, token: str | None, timeout_s: float = 30.0, ssl_context: ssl.SSLContext | None = None
    ) -> None:
        url = url.rstrip("/")
        if url.endswith(API):
            url = url[: -len(API)]
        if not url.startswith(("http://", "https://")):
            raise InvalidArgument(f"--url: {url!r} is not an http(s) URL of the master's REST API")
        self.url = url
        self.token = token
        self.timeout_s = timeout_s
        self.ssl_context = ssl_context  # https: verify the master with this CA bundle (None: system roots)

    def get(self, path: str, **query: Any) -> Any:
        return self.call("GET", path, **query)

    def call(self, method: str, path: str, **query: Any) -> Any:
        q = urllib.parse.urlencode({k: v for k, v in query.items() if v not in (None, "")}, doseq=True)
        req = urllib.request.Request(f"{self.url}{API}{path}{'?' + q if q else ''}", method=method)
        req.add_header("Accept", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        for attempt in range(RETRIES_429 + 1):
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s, context=self.ssl_context) as resp:
                    return json.loads(resp.read() or b"null")
            except urllib.error.HTTPError as e:
                body = e.read()
                if e.code != 429 or attempt == RETRIES_429:
                    raise http_error(e.code, body) from None
                time.sleep(retry_after_s(e.headers.get("Retry-After"), body))
            except (urllib.error.URLError, OSError) as e:
                reason = getattr(e, "reason", e)
                raise Unavailable(
                    f"cannot reach the master's REST API at {self.url} ({reason}); start it, or point "
                    f"--url / ${ENV_URL} at it"
                ) from None
        raise AssertionError("unreachable: the last attempt returns or raises")


def retry_after_s(header: str | None, body: bytes) -> float:
    """How long a 429 asks to wait: its ``Retry-After`` (seconds, or an HTTP date), else the body's
    ``retry_after_s``, else one second; at most ``MAX_RETRY_AFTER_S``."""
    wait: float | None = None
    if header:
        try:
            wait = float(header)
        except ValueError:
            try:
                wait = email.utils.parsedate_to_datetime(header).timestamp() - time.time()
            except (TypeError, ValueError):
                wait = None
    if wait is None:
        try:
            obj = json.loads(body)
            wait = float(obj["retry_after_s"]) if isinstance(obj, Mapping) else None
        except (ValueError, KeyError, TypeError):
            wait = None
    if wait is None or not math.isfinite(wait):
        wait = 1.0
    return min(max(wait, 0.0), MAX_RETRY_AFTER_S)


def http_error(status: int, body: bytes) -> StagetreeError:
    """The core error for an HTTP error answer of the master (``{"error": CODE, "message": ...}``)."""
    try:
        obj = json.loads(body)
    except ValueError:
        obj = None
    if isinstance(obj, Mapping) and isinstance(obj.get("error"), str):
        cls = _ERRORS.get(obj["error"], StagetreeError)
        msg = str(obj.get("message", ""))
        if cls.code == "UNAUTHENTICATED":
            msg += f"; pass --token or set ${ENV_TOKEN}"
        return cls(msg)
    if isinstance(obj, Mapping) and "detail" in obj:  # FastAPI's own validation answer
        return InvalidArgument(f"the master rejected the request ({status}): {json.dumps(obj['detail'])[:500]}")
    return StagetreeError(f"the master answered HTTP {status}: {body[:200]!r}")


# ---------------------------------------------------------------------------------------------
# Pure helpers and formatting


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells)


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


def _num(v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return json.dumps(v)
    if isinstance(v, int):
        return str(v)
    return f"{v:.6g}"


def describe_segment(seg: Sequence[Any]) -> str:
    """``[start, end, kind, [dtype, *params]]`` (the canonical JSON of a segment) as text."""
    kind, params = seg[2], list(seg[3])[1:]
    p = [_num(x) for x in params]
    if kind == "const":
        return p[0]
    if kind == "linear":
        return f"linear({p[0]}, {p[1]}/step)"
    if kind == "exp":
        return f"exp({p[0]}, x{p[1]}/step)"
    if kind == "step":
        return f"step({p[0]}, every {p[1]}, x{p[2]})"
    if kind == "cosine":
        return f"cosine({p[0]}->{p[1]}, period {p[2]}, x{p[3]})"
    if kind == "cyclic":
        return f"cyclic({p[0]}..{p[1]}, up {p[2]}, down {p[3]})"
    return f"{kind}({', '.join(p)})"


def describe_sequence(segments: Sequence[Sequence[Any]], start: int = 0, until: int | None = None) -> str:
    """The segments in force on [start, until) as ``0.1, @30 0.01``."""
    parts = []
    for seg in segments:
        s, e = int(seg[0]), seg[1]
        if e is not None and int(e) <= start:
            continue
        if until is not None and s >= until:
            break
        text = describe_segment(seg)
        parts.append(text if s <= start else f"@{s} {text}")
    return ", ".join(parts)


def describe_config(config: Mapping[str, Any], start: int = 0, until: int | None = None) -> str:
    return " ".join(f"{n}={describe_sequence(config[n], start, until)}" for n in sorted(config))


def format_studies(studies: Sequence[Mapping[str, Any]]) -> str:
    if not studies:
        return "no studies (create one with the SDK or POST /api/v1/studies)"
    rows = [
        (s["id"], s["name"], s["owner"], _when(s.get("created_at", 0)), (s.get("fixed") or {}).get("trainer", "-"))
        for s in studies
    ]
    return _table(["ID", "NAME", "OWNER", "CREATED", "TRAINER"], rows)


def study_summary(study: Mapping[str, Any], requests: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    states = Counter(r["state"] for r in requests)
    names = sorted({k for r in requests for k in (r.get("metrics") or {})})
    return {
        "study": dict(study),
        "requests": {"total": len(requests), "by_state": dict(sorted(states.items()))},
        "metrics": names,
        "max_step": max((r["step"] for r in requests), default=None),
        "trials": trials(requests),
        "failures": [
            {k: r.get(k) for k in ("request_id", "label", "step", "error")}
            for r in sorted(requests, key=lambda r: r["request_id"])
            if r["state"] == "FAILED"
        ],
    }


def trials(requests: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The requests grouped by trial label (the tuner's trial ids), in the order trials started: evals,
    last step asked, and the state of the latest eval. Unlabelled requests are left out."""
    out: dict[str, dict[str, Any]] = {}
    for r in sorted(requests, key=lambda r: r["request_id"]):
        label = r.get("label") or ""
        if not label:
            continue
        t = out.setdefault(label, {"label": label, "evals": 0, "last_step": 0, "state": ""})
        t["evals"] += 1
        if r["step"] >= t["last_step"]:
            t["last_step"], t["state"] = r["step"], r["state"]
    return list(out.values())


def format_stats(stats: Mapping[str, Any]) -> str:
    reqs = ", ".join(f"{k} {v}" for k, v in sorted(stats["requests"].items())) or "none"
    return "\n".join(
        [
            f"requests            {reqs}",
            f"steps executed      {stats['steps_executed']}",
            f"unique steps        {stats['unique_steps']}",
            f"trial-by-trial      {stats['trial_by_trial_steps']}  (each trial trained alone to its last step)",
            f"merge rate          {stats['merge_rate']:.2f}  (trial-by-trial / unique)",
            f"steps saved         {stats['saved_steps']}",
            f"compute seconds     {stats['compute_seconds']:.1f} used, {stats['saved_seconds']:.1f} saved",
            f"other seconds       {stats.get('queue_seconds', 0.0):.1f} queued, "
            f"{stats.get('startup_seconds', 0.0):.1f} starting workers, "
            f"{stats.get('checkpoint_seconds', 0.0):.1f} checkpoint I/O",
        ]
    )


def format_study(summary: Mapping[str, Any]) -> str:
    s = summary["study"]
    fixed = s.get("fixed") or {}
    reqs = summary["requests"]
    states = ", ".join(f"{k} {v}" for k, v in reqs["by_state"].items()) or "none"
    lines = [
        f"study     {s['name']} ({s['id']})",
        f"owner     {s['owner']}",
        f"created   {_when(s.get('created_at', 0))}",
        f"trainer   {fixed.get('trainer', '-')}",
        f"dataset   {fixed.get('dataset', '') or '-'}",
        f"model     {fixed.get('model', '') or '-'}",
        f"seed      {fixed.get('seed', '-')}",
        f"fixed     {json.dumps(fixed.get('values', {}), sort_keys=True)}",
        f"requests  {reqs['total']} ({states})",
        f"metrics   {', '.join(summary['metrics']) or '-'}",
    ]
    if summary.get("max_step") is not None:
        lines.append(f"max step  {summary['max_step']}")
    shown = summary.get("trials", [])[:MAX_TRIALS_SHOWN]
    if shown:
        lines.append(f"trials    {len(summary['trials'])}")
        table = _table(
            ["TRIAL", "EVALS", "LAST STEP", "STATE"],
            [(t["label"], t["evals"], t["last_step"], t["state"]) for t in shown],
        )
        lines.extend("  " + row for row in table.splitlines())
        if len(summary["trials"]) > len(shown):
            lines.append(f"  ... {len(summary['trials']) - len(shown)} more (--json lists them all)")
    failures = summary.get("failures", [])
    if failures:
        first = failures[0]
        lines.append(f"failed    {len(failures)} request(s); the first, {first['request_id']} at step {first['step']}:")
        lines.extend("  " + ln for ln in str(first.get("error") or "no reason given").splitlines())
        for f in failures[1:MAX_TRIALS_SHOWN]:
            head = (str(f.get("error") or "").splitlines() or [""])[0]
            lines.append(f"  request {f['request_id']} at step {f['step']}: {head}")
    return "\n".join(lines)


def best_request(requests: Sequence[Mapping[str, Any]], metric: str, mode: str) -> Mapping[str, Any] | None:
    """The DONE request with the best ``metric`` (ties to the lower request id); None if none has it."""
    if mode not in ("max", "min"):
        raise InvalidArgument(f"--mode: must be max or min, got {mode!r}")
    best, key = None, None
    for r in sorted(requests, key=lambda r: r["request_id"]):
        v = (r.get("metrics") or {}).get(metric)
        if r["state"] != "DONE" or v is None or (isinstance(v, float) and math.isnan(v)):
            continue
        k = v if mode == "max" else -v
        if key is None or k > key:
            best, key = r, k
    return best


def format_best(result: Mapping[str, Any]) -> str:
    r = result["request"]
    metric = result["metric"]
    lines = [
        f"best {metric} ({result['mode']}): {_num(r['metrics'][metric])}",
        f"request   {r['request_id']} (client id {r['client_request_id']})",
        f"point     node {r['node']}, step {r['step']}",
        "metrics   " + ", ".join(f"{k}={_num(v)}" for k, v in sorted(r["metrics"].items())),
    ]
    if result.get("config"):
        lines.append(f"config    {config_text(result['config'])}")
    return "\n".join(lines)


def format_plan(plan: Mapping[str, Any]) -> str:
    """The search plan as a tree: each node (``#id @start``) with the schedules of the hyper-parameters
    that change at its start (in the printed form, ``core.seqforms``), its requests by state, and the steps
    holding checkpoints and metrics."""
    nodes = {n["id"]: n for n in plan["nodes"]}
    kids: dict[int | None, list[int]] = {}
    for n in plan["nodes"]:
        parent = n.get("parent") or None
        kids.setdefault(parent if parent in nodes else None, []).append(n["id"])
    for lst in kids.values():
        lst.sort(key=lambda i: (nodes[i]["start"], i))
    fixed = plan.get("fixed") or {}
    total = Counter[str]()
    for n in plan["nodes"]:
        total.update(n.get("requests") or {})
    head = [
        f"plan {plan['key']}  trainer={fixed.get('trainer', '-')} dataset={fixed.get('dataset', '') or '-'} "
        f"model={fixed.get('model', '') or '-'} seed={fixed.get('seed', '-')}",
        f"{len(nodes)} nodes; requests: " + (", ".join(f"{k} {v}" for k, v in sorted(total.items())) or "none"),
    ]
    lines: list[str] = []

    def label(n: Mapping[str, Any]) -> str:
        start = int(n["start"])
        parent = nodes.get(n.get("parent") or -1)
        segs = n.get("segments", n["config"])
        if parent is None:
            hp = config_text(segs)
        else:
            psegs = parent.get("segments", parent["config"])
            changed = {
                k: v
                for k, v in segs.items()
                if describe_sequence(v, start) != describe_sequence(psegs.get(k, []), start)
            }
            hp = config_text(changed) or "(same as parent)"
        reqs = n.get("requests") or {}
        bits = [f"#{n['id']} @{start} {hp}"]
        if reqs:
            bits.append("req " + " ".join(f"{k}:{v}" for k, v in sorted(reqs.items())))
        if n.get("checkpoint_steps"):
            bits.append("ckpt " + ",".join(str(s) for s in n["checkpoint_steps"]))
        if n.get("metric_steps"):
            bits.append("metrics " + ",".join(str(s) for s in n["metric_steps"]))
        return "  |  ".join(bits)

    def walk(nid: int, prefix: str, last: bool, root: bool) -> None:
        branch = "" if root else ("└─ " if last else "├─ ")
        lines.append(prefix + branch + label(nodes[nid]))
        children = kids.get(nid, [])
        for i, c in enumerate(children):
            walk(c, prefix + ("" if root else ("   " if last else "│  ")), i == len(children) - 1, False)

    for r in kids.get(None, []):
        walk(r, "", True, True)
    return "\n".join(head + lines)


def format_hosts(hosts: Sequence[Mapping[str, Any]], now: float | None = None) -> str:
    if not hosts:
        return "no node managers registered"
    now = time.time() if now is None else now
    rows = []
    for n in hosts:
        gpus = Counter(s.get("gpu_type", "cpu") for s in n.get("slots", []))
        slots = ", ".join(f"{v}x {k}" for k, v in sorted(gpus.items())) or "-"
        age = now - float(n.get("last_heartbeat") or 0)
        rows.append((n["node_manager_id"], n.get("state", "-"), f"{age:.0f}s ago", len(n.get("slots", [])), slots))
    return _table(["NODE MANAGER", "STATE", "HEARTBEAT", "SLOTS", "KINDS"], rows)


# ---------------------------------------------------------------------------------------------
# Commands


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=None, help=f"the master's REST API (default ${ENV_URL} or {DEFAULT_URL})")
    common.add_argument("--token", default=None, help=f"bearer token (default ${ENV_TOKEN}, or ${ENV_TOKEN}_FILE)")
    common.add_argument("--token-file", default=None, help="read the bearer token from this file (a mounted secret)")
    common.add_argument(
        "--ca-file",
        default=None,
        help=f"CA bundle that signed the master's certificate, for https URLs (default ${ENV_CLIENT_PREFIX}CA_FILE)",
    )
    common.add_argument("--json", action="store_true", help="print one JSON document (for scripts)")

    p = argparse.ArgumentParser(prog="stagetree", description="stagetree client commands")
    sub = p.add_subparsers(dest="group", required=True)
    study = sub.add_parser("study", help="studies")
    ssub = study.add_subparsers(dest="command", required=True)
    ssub.add_parser("list", parents=[common], help="the studies of this token's owner")
    show = ssub.add_parser("show", parents=[common], help="one study and its requests by state")
    show.add_argument("study_id", metavar="STUDY", help="the study's id or name")
    best = ssub.add_parser("best", parents=[common], help="the finished request with the best metric")
    best.add_argument("study_id", metavar="STUDY", help="the study's id or name")
    best.add_argument("--metric", required=True, help="a metric your Trainer.evaluate() reports, e.g. acc")
    best.add_argument("--mode", choices=["max", "min"], default="max")
    stats = ssub.add_parser("stats", parents=[common], help="what sharing bought the study")
    stats.add_argument("study_id", metavar="STUDY", help="the study's id or name")
    delete = ssub.add_parser(
        "delete", parents=[common], help="cancel the study's live requests and delete it (its plans are kept)"
    )
    delete.add_argument("study_id", metavar="STUDY", help="the study's id or name")
    plan = sub.add_parser("plan", help="search plans")
    psub = plan.add_subparsers(dest="command", required=True)
    pshow = psub.add_parser("show", parents=[common], help="a study's search plan as a tree")
    pshow.add_argument("study_id", metavar="STUDY", help="the study's id or name")
    pshow.add_argument("--plan-key", default="", help="which plan, when the study uses several")
    forget = psub.add_parser(
        "forget", parents=[common], help="drop a plan's checkpoints and metrics (and the requests they answered)"
    )
    forget.add_argument("study_id", metavar="STUDY", help="the study's id or name")
    forget.add_argument("--plan-key", default="", help="which plan, when the study uses several")
    sub.add_parser("hosts", parents=[common], help="the hosts: node managers and their slots (admin token)")
    sub.add_parser("nodes", parents=[common], help="deprecated: `hosts` (removed in the next release)")
    return p


def study_id_of(rest: RestClient, ref: str) -> str:
    """The id of the study ``ref`` names: its id, or its name among this token's owner's studies."""
    try:
        return str(rest.get(f"/studies/{_quote(ref)}")["id"])
    except NotFound:
        pass  # not an id of a study this token may see: a name, then
    for s in rest.get("/studies"):
        if s["name"] == ref:
            return str(s["id"])
    raise NotFound(f"no study with the id or name {ref!r} (`stagetree study list` shows yours)")


def run(ns: argparse.Namespace, rest: RestClient) -> tuple[Any, str, int]:
    """Carry out a parsed command: (JSON document, text, exit status)."""
    if getattr(ns, "study_id", None) is not None:
        ns.study_id = study_id_of(rest, ns.study_id)
    if ns.group in ("hosts", "nodes"):
        if ns.group == "nodes":
            print("stagetree: `nodes` is deprecated, use `stagetree hosts`", file=sys.stderr)
        hosts = rest.get("/hosts")
        return hosts, format_hosts(hosts), 0
    if ns.group == "plan" and ns.command == "forget":
        out = rest.call("POST", f"/studies/{_quote(ns.study_id)}/plan/forget", plan_key=ns.plan_key)
        text = (
            f"forgot {out['checkpoints']} checkpoints ({out['bytes_freed']} bytes freed), {out['metrics']} metric "
            f"points and {out['requests']} finished requests"
        )
        return out, text, 0
    if ns.group == "plan":
        plan = rest.get(f"/studies/{_quote(ns.study_id)}/plan", plan_key=ns.plan_key)
        return plan, format_plan(plan), 0
    if ns.command == "list":
        studies = rest.get("/studies")
        return studies, format_studies(studies), 0
    if ns.command == "stats":
        stats = rest.get(f"/studies/{_quote(ns.study_id)}/stats")
        return stats, format_stats(stats), 0
    if ns.command == "delete":
        out = rest.call("DELETE", f"/studies/{_quote(ns.study_id)}")
        return out, f"deleted study {out['id']} and {out['requests_deleted']} requests; plans {out['plans']}", 0
    study = rest.get(f"/studies/{_quote(ns.study_id)}")
    requests = rest.get(f"/studies/{_quote(ns.study_id)}/requests")
    if ns.command == "show":
        summary = study_summary(study, requests)
        return summary, format_study(summary), 0
    found = best_request(requests, ns.metric, ns.mode)
    if found is None:
        doc = {"study_id": study["id"], "metric": ns.metric, "mode": ns.mode, "request": None, "config": None}
        return doc, f"no finished request of study {study['name']!r} reports metric {ns.metric!r}", 1
    config = _node_config(rest, ns.study_id, found["node"])
    doc = {"study_id": study["id"], "metric": ns.metric, "mode": ns.mode, "request": found, "config": config}
    return doc, format_best(doc), 0


def _node_config(rest: RestClient, study_id: str, node: int) -> dict[str, Any] | None:
    """The config of a plan node in the family form (None when the study uses several plans)."""
    try:
        plan = rest.get(f"/studies/{_quote(study_id)}/plan")
    except InvalidArgument:
        return None
    for n in plan["nodes"]:
        if n["id"] == node:
            return dict(n["config"])
    return None


def _quote(s: str) -> str:
    return urllib.parse.quote(s, safe="")


def _token(ns: argparse.Namespace) -> str | None:
    """--token, --token-file, $STAGETREE_TOKEN or the file $STAGETREE_TOKEN_FILE names (never printed)."""
    if ns.token and ns.token_file:
        raise InvalidArgument("--token and --token-file: give one")
    if ns.token_file:
        return read_secret_file(ns.token_file, "--token-file") or None
    return ns.token or env_or_file(ENV_TOKEN) or None


def _ssl_context(ca_file: str | None) -> ssl.SSLContext | None:
    tls = ClientTls.from_env()
    if ca_file:
        tls = tls.model_copy(update={"ca_file": ca_file, "cert_file": "", "key_file": ""})
    return tls.ssl_context() if tls.ca_file else None


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        ns = _parser().parse_args(args)
    except SystemExit as e:  # argparse printed the usage
        return int(e.code or 0)
    try:
        rest = RestClient(
            ns.url or os.environ.get(ENV_URL) or DEFAULT_URL, _token(ns), ssl_context=_ssl_context(ns.ca_file)
        )
        doc, text, status = run(ns, rest)
    except StagetreeError as e:
        if ns.json:
            print(json.dumps({"error": e.code, "message": e.message}))
        print(f"stagetree {ns.group}: {e.message}", file=sys.stderr)
        return 1
    if ns.json:
        print(json.dumps(doc, indent=2, sort_keys=True))
        if status:
            print(text, file=sys.stderr)
    else:
        print(text, file=sys.stderr if status else sys.stdout)
    return status


if __name__ == "__main__":
    sys.exit(main())
