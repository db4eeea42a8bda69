"""``docs/benchmarks.md`` and the README's headline block, written from ``tests/bench/results/*.json``.

``python -m tests.bench.report`` writes them; every bench does it when it ends (``tests.bench.record``).
``BENCHES`` is the one list of benches: the command, what it measures, and its targets as expressions
over the last line's figures (``cpu_s_ratio >= 0.9 * merge_rate``), checked here against the last run.
A bench with no results file is listed as not run on this code.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "tests" / "bench" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"
START, END = "<!-- benchmarks:start -->", "<!-- benchmarks:end -->"


@dataclass(frozen=True)
class Bench:
    name: str  # its module under tests/bench and its results file's name
    what: str
    targets: tuple[str, ...] = ()
    command: str = ""  # when it is not `python -m tests.bench.<name>`
    results: str = ""  # its results file's stem when it is not `name` (gpu: one per device)

    @property
    def cmd(self) -> str:
        return self.command or f"python -m tests.bench.{self.name}"


HEADLINE = ("vs_raytune", "vs_optuna", "scale")

BENCHES = (
    Bench(
        "vs_raytune",
        "the same workloads (shared-prefix grids) on stagetree and on Ray Tune, every process of each counted",
        ("cpu_s_ratio_s1 >= 0.9 * merge_rate", "exact"),
        command='pip install ".[bench]" && python -m tests.bench.vs_raytune',
    ),
    Bench(
        "vs_optuna",
        "an Optuna user's script (TPE, median pruner, 40 trials) against its port to stagetree by the docs, "
        "every process and the start-up counted; the no-sharing figure from both systems replaying Optuna's "
        "trials, each to the step it reached",
        (
            "stagetree_best >= optuna_best - 0.005",
            "cpu_s_ratio >= 0.9 * merge_rate",
            "cpu_s_ratio_no_sharing >= 0.9",
            "e2e_ratio >= 1.0",
            "first_trial_s <= 5",
            "steps_trained_twice == 0",
        ),
    ),
    Bench(
        "scale",
        "rounds as pending work grows to 100k; 1,600 simulated GPU slots and 50 ASHA studies live",
        (
            "round_growth_exp <= 1.1",
            "submit_vs_raw_insert >= 0.3",
            "occupancy >= 0.95",
            "assign_ms_p99 <= 500",
            "master_rss_mb <= 2048",
        ),
    ),
    Bench("warm", "a user-style study of ~40 short batches, every process counted: this tree against another "
          "commit's (warm workers, preload, the start)", ("cpu_ratio >= 1.0",),
          command="python -m tests.bench.warm --base <commit>"),
    Bench("overhead", "where the platform's own CPU goes on vs_optuna's port of an Optuna user's script, with "
          "nothing shared (its start, the script's process while the study runs, the rounds, the workers beyond "
          "training), measured inside the processes, this tree beside another commit's, alternately", (),
          command="python -m tests.bench.overhead --pairs 3 --baseline <commit>"),
    Bench("master", "10,000 requests through gRPC into Postgres, round time, cached evaluations",
          ("submit_per_s >= 2000", "round_ms_10k <= 250", "cached_eval_p99_ms <= 20")),
    Bench("master", "the round at 10,000 pending beside another commit's, alternately, each run a child process "
          "importing its own tree: `round_vs_baseline` = this tree's median round / the commit's, against "
          "02172b5 (the code before the pure round)", ("round_vs_baseline <= 1.1",),
          command="python -m tests.bench.master --baseline 02172b5 --pairs 3", results="master_vs_baseline"),
    Bench("worker", "the runtime against a plain PyTorch loop, checkpoint save and load, exact resume",
          ("runtime_overhead <= 1.05", "resume_exact")),
    Bench("pipeline", "metric points through Kafka (Tansu) and an aggregator into Postgres; the demo's study. "
          "With `--baseline <commit>` (and `--pairs N`, default 2), the steady case of this tree and of that "
          "commit's tree (a temporary git worktree first on the children's PYTHONPATH) alternately on the "
          "same broker and Postgres: `ingest_vs_baseline` = this tree's median rate / the commit's, against "
          "635df8a (the code before the one-ingest change)",
          ("ingest_points_per_s >= 20000", "dup_applied == 0", "lost == 0", "embedded_overhead <= 1.15",
           "ingest_vs_baseline >= 0.9"),
          command="python -m tests.bench.pipeline [--baseline 635df8a --pairs 2]"),
    Bench("embedded", "the demo's study in embedded mode against an ideal platform's makespan",
          ("embedded_steps_vs_unique == 1.0", "embedded_overhead <= 1.15")),
    Bench("sqlite_rows", "the embedded store's SQLite reads as one JSON array against SQLAlchemy's row by row",
          ("same_rows", "speedup >= 1.5")),
    Bench("messages", "the bus messages' codec per message, against pydantic's TypeAdapter and msgspec"),
    Bench("client", "2,000 concurrent evaluations from one asyncio client",
          ("evals_per_s >= 1000", "rpcs_per_eval <= 0.1", "asha_promotions_ok")),
    Bench("policies", "the four papers' comparisons in the simulator",
          ("hermes_vs_best_baseline >= 1.3", "pop_vs_best_baseline >= 1.3", "wfd_vs_one_per_gpu >= 2.0",
           "wfd_occupancy_vs_exact >= 0.95", "genie_qos_vs_best_baseline >= 1.2")),
    Bench("scheduler", "simulated grid and ASHA studies, 8 and 40 workers, three orders"),
    Bench("ledger", "one mixed report sequence through gRPC and through the bus: the same database?",
          ("same_state", "ingest_functions == 1", "event_definitions == 0", "store_max_class_lines <= 400",
           "status_tables == 1")),
    Bench("cluster", "48-trial SHA on the process cluster: clean, a node manager killed, the master killed",
          ("results_lost == 0", "results_duplicated == 0", "recovery_s_p50 <= 10")),
    Bench("researcher", "an edited trainer, a trainer that raises, a 48-trial grid of schedule families",
          ("not stale_after_edit", "traceback_shown", "user_error_attempts == 1", "stats_public")),
    Bench("faults", "REST and gRPC fuzzed; PostgreSQL and the broker restarted; 20 clients' overload",
          ("server_errors == 0", "spec_violations == 0", "pg_restart_lost == 0", "broker_restart_lost == 0",
           "duplicated == 0", "overload_accepted_lost == 0", "overload_rss_growth_mb <= 200")),
    Bench("multihost", "three hosts as network namespaces, S3 checkpoints, partitions (needs root)",
          ("hosts >= 3", "results_lost == 0", "results_duplicated == 0")),
    Bench("deploy", "every overlay and compose file rendered; a study over mutual TLS against plaintext",
          ("problems == 0", "tls_study_ok", "tls_overhead <= 1.05", "tokens_in_logs == 0")),
    Bench("dashboard", "2,000 trials with 200-point curves, a 10,000-node tree; the pages in headless Chromium",
          ("study_page_ms <= 1500", "tree_page_ms <= 1500", "live_update_ms <= 1000", "trial_page_ms <= 500",
           "eval_metric_plotted", "traceback_in_ui", "rebuilds_of_idle_study == 0")),
    Bench("multigpu", "1 against 2 gloo ranks: step time, metrics, exact resume, a killed rank, OOM doubling",
          ("resume_exact", "speedup_2_vs_1 >= 1.5", "killed_rank_cleanup", "oom_doubled")),
    Bench("gpu", "On an NVIDIA GPU: CUDA resume, OOM, preemption, packing through the master, Ray Tune's "
          "GPU-seconds, a 2-rank NCCL batch",
          ("resume_exact", "mps_packing_vs_one >= 2.0", "preempt_s <= 2", "preempt_frees_memory",
           "gpu_s_ratio_vs_raytune >= 0.8 * raytune_merge_rate", "nccl_batch_ok"),
          results="gpu-*"),
    Bench("first_hour", "a new user's first hour in a pty: the README quickstart, edited and run again, a trainer that "
          "raises, one schedule's printed forms, the tuner docs; first_result_s beside a plain Optuna script's",
          ("not stale_after_edit_loaded", "progress_shown", "schedule_forms == 1", "undocumented_public == 0")),
)  # fmt: skip


def load(bench: Bench) -> list[dict[str, Any]]:
    """The bench's results documents (several for the GPU bench: one per device), newest name first."""
    docs = []
    for path in sorted(RESULTS.glob(f"{bench.results or bench.name}.json")):
        doc = json.loads(path.read_text())
        doc.setdefault("line", " ".join(f"{k}={_fmt(v)}" for k, v in doc.get("figures", {}).items()))
        doc["_file"] = path.relative_to(ROOT).as_posix()
        docs.append(doc)
    return docs


def check(target: str, figures: dict[str, Any]) -> bool | None:
    """Whether ``figures`` meet ``target`` (None: a figure it needs was not measured)."""
    names = set(re.findall(r"[A-Za-z_]\w*", target)) - {"not", "and", "or"}
    if any(figures.get(n) is None for n in names):
        return None
    return bool(eval(target, {"__builtins__": {}}, dict(figures)))  # our own expressions, above


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "nan"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _verdict(bench: Bench, figures: dict[str, Any]) -> str:
    got = [check(t, figures) for t in bench.targets]
    if not got:
        return "no targets"
    missed = [t for t, ok in zip(bench.targets, got, strict=True) if ok is False]
    unknown = [t for t, ok in zip(bench.targets, got, strict=True) if ok is None]
    parts = []
    if missed:
        parts.append("missed: " + ", ".join(f"`{t}`" for t in missed))
    if unknown:
        parts.append("not measured: " + ", ".join(f"`{t}`" for t in unknown))
    return "; ".join(parts) or "all met"


def _where(doc: dict[str, Any]) -> str:
    m = doc.get("machine") or {}
    where = f"{m.get('cores')} cores, {m.get('memory_gib')} GiB" if m else str(doc.get("device", ""))
    if m.get("load_1m") is not None:
        where += f", load {m['load_1m']}"
    commit = f", commit {doc['commit']}" if doc.get("commit") else ""
    return f"{doc.get('date', '?')}, {where}{commit}"


def render_page() -> str:
    out = [
        "# Benchmarks",
        "",
        "Each figure here is the last line of a bench's last run, as it wrote it to `tests/bench/results/`;",
        "this page is written from those files (`python -m tests.bench.report`, which every bench runs when it",
        "ends). Benches are scripts, not timed tests. This machine's speed moves by 20-40% from hour to hour,",
        "so the figures that matter are ratios to a reference measured in the same run; absolute rates are",
        "shown with the machine and its load when they were taken.",
        "",
    ]
    for b in BENCHES:
        out += [f"## {b.name}", "", b.what + ".", "", "```bash", b.cmd, "```", ""]
        if b.targets:
            out += ["Targets: " + ", ".join(f"`{t}`" for t in b.targets) + ".", ""]
        docs = load(b)
        if not docs:
            out += ["Not run on this code yet: no results file.", ""]
        for doc in docs:
            out += [
                f"Last run ({_where(doc)}; [{Path(doc['_file']).name}](../{doc['_file']})):",
                "",
                "```",
                doc["line"],
                "```",
                "",
                f"Targets: {_verdict(b, doc.get('figures', {}))}.",
                "",
            ]
    return "\n".join(out).rstrip() + "\n"


def render_headline() -> str:
    lines = [START, "", "| comparison | command | last run | figures | targets |", "| --- | --- | --- | --- | --- |"]
    for name in HEADLINE:
        b = next(x for x in BENCHES if x.name == name)
        docs = load(b)
        if docs:
            doc = docs[0]
            cells = (doc.get("date", "?"), f"`{doc['line']}`", _verdict(b, doc.get("figures", {})))
        else:
            cells = ("not run on this code yet", "", "")
        lines.append(f"| {b.what} | `{b.cmd}` | {cells[0]} | {cells[1]} | {cells[2]} |")
    lines += ["", "Every bench, its targets and its last run: [docs/benchmarks.md](docs/benchmarks.md).", "", END]
    return "\n".join(lines)


def readme_with_headline(text: str) -> str:
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"README.md lacks the {START} ... {END} block")
    return text[:start] + render_headline() + text[end + len(END) :]


def write_pages() -> None:
    PAGE.write_text(render_page())
    README.write_text(readme_with_headline(README.read_text()))


if __name__ == "__main__":
    write_pages()
    print(f"wrote {PAGE.relative_to(ROOT)} and the headline block of {README.relative_to(ROOT)}")
