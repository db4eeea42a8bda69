"""The shapes of the dashboard's JSON reads, for the OpenAPI spec (``/api/v1/openapi.json``) and the
checks FastAPI makes on each answer. ``views``, ``tree`` and ``cluster`` build plain dicts of these
shapes; a field's description says what it means where its name does not.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from stagetree.master.api.openapi import MetricValue

RequestStateName = Literal["NOT_SCHED", "SCHED", "DONE", "FAILED", "CANCELLED"]
NodeStateName = Literal["waiting", "running", "done", "failed", "cancelled", "idle"]
StudyStateName = Literal["empty", "waiting", "running", "done", "failed"]
Feature = float | str | bool
Metrics = dict[str, MetricValue]


class _Out(BaseModel):
    # a diverged loss is "NaN" in every REST answer (openapi.METRIC_VALUE)
    model_config = ConfigDict(ser_json_inf_nan="strings")


class Best(_Out):
    metric: str
    mode: Literal["min", "max"]
    value: MetricValue
    trial: str = Field(description="the trial's key: its label, or #<request id> when it has none")
    label: str
    request_id: int
    step: int


class StudyRow(_Out):
    id: str
    name: str
    owner: str
    created_at: float
    state: StudyStateName
    first_request_at: float | None
    last_done_at: float | None
    duration_s: float | None = Field(description="from its first request to its last answer (to now while live)")
    counts: dict[str, int] = Field(description="requests by state")
    trials: int
    trial_counts: dict[str, int] = Field(description="trials by state (a trial is its latest rung's state)")
    best: Best | None
    merge_rate: float
    steps_executed: int
    saved_steps: int
    saved_seconds: float


class Rung(_Out):
    request_id: int
    step: int
    state: RequestStateName
    metrics: Metrics
    done_at: float | None


class TrialRow(_Out):
    key: str = Field(description="its label, or #<request id> when it has none")
    label: str
    request_id: int = Field(description="its first request")
    state: RequestStateName
    node: int = Field(description="the plan node of its furthest rung")
    step: int = Field(description="its furthest rung's step")
    metrics: Metrics = Field(description="at its highest finished rung")
    metric_step: int | None
    rungs: list[Rung]
    schedule: str
    features: dict[str, Feature] = Field(description="the tuned choices its schedules stand for")
    error: str = Field(description="what was raised, when it failed")
    started_at: float | None


class StudyPage(_Out):
    study: dict[str, Any]
    state: StudyStateName
    stats: dict[str, Any]
    counts: dict[str, int]
    trial_counts: dict[str, int]
    metrics: list[str] = Field(description="evaluation metrics (what evaluate() returned)")
    modes: dict[str, Literal["min", "max"]]
    features: list[str] = Field(description="the tuned choices that vary between the trials")
    importance: dict[str, dict[str, float]] = Field(description="metric -> feature -> its share (sums to 1)")
    best: Best | None
    trials: list[TrialRow]


class HpSchedule(_Out):
    name: str
    text: str
    numeric: bool
    points: list[list[float]] = Field(description="[step, value] over the trial's steps, and at each jump")


class TrialRung(_Out):
    request_id: int
    step: int
    state: RequestStateName
    node: int
    metrics: Metrics
    error: str
    batch_id: int | None
    created_at: float | None
    done_at: float | None


class FailureOut(_Out):
    headline: str
    traceback: str
    log_path: str = Field(description="the worker's log on its node manager's host")
    node_manager: str


class AttemptOut(_Out):
    batch_id: int
    attempt: int
    node_manager: str
    slot: str = Field(description="its rank 0's slot")
    slots: list[str] = Field(description="every slot it held, in rank order")
    state: str
    dispatched_at: float
    started_at: float | None
    finished_at: float | None


class SharedTrial(_Out):
    key: str
    until: int = Field(description="the last step of this piece the other trial shares")


class PathPiece(_Out):
    node: int
    start: int
    end: int
    shared_with: int = Field(description="how many other trials of the study ran some of these steps")
    shared_steps: int
    trials: list[SharedTrial]


class TrialCurve(_Out):
    total: int
    points: list[tuple[int, Metrics]]


class TrialPage(_Out):
    study: dict[str, str]
    key: str
    label: str
    state: RequestStateName
    plan_id: int
    node: int
    step: int
    trained: int = Field(description="its highest finished rung's step")
    features: dict[str, Feature]
    schedule: dict[str, Any] = Field(description='{"text": ..., "hps": [HpSchedule]}')
    rungs: list[TrialRung]
    failure: FailureOut | None
    curve: TrialCurve
    attempts: list[AttemptOut]
    path: list[PathPiece]


class NodeSeries(_Out):
    node: int
    parent: int | None
    start: int
    total: int
    points: list[tuple[int, MetricValue]]
    times: list[float] | None = None


class TrialSeries(_Out):
    key: str
    node: int
    state: RequestStateName
    points: list[tuple[int, MetricValue, float | None]] = Field(description="[step, value, when answered]")


class Curves(_Out):
    as_of: float | None
    metric: str | None
    kind: Literal["step", "eval"] | None
    metrics: list[str] = Field(description="step metrics (what train() returned)")
    eval_metrics: list[str] = Field(description="evaluation metrics (what evaluate() returned)")
    nodes: list[NodeSeries] = Field(default_factory=list, description="step metrics: each plan node's own points")
    trials: list[TrialSeries] = Field(default_factory=list, description="evaluation metrics: each trial's rungs")


class TreeNode(_Out):
    id: int
    parent: int | None
    start: int
    end: int
    trained: int
    state: NodeStateName
    progress: float | None
    checkpoints: list[int]
    evals: int
    trials: int = Field(description="trials of the study whose path passes through it")
    rescaled: bool = Field(description="training resumed a checkpoint on another number of ranks here")


class TreeTrial(_Out):
    key: str
    node: int
    step: int
    state: RequestStateName


class Tree(_Out):
    key: str
    nodes: list[TreeNode]
    trials: list[TreeTrial]


class NodeTrial(_Out):
    key: str
    label: str
    state: RequestStateName
    step: int
    until: int = Field(description="the last step it trains on this node")
    ends_here: bool
    metrics: Metrics
    error: str


class TreeNodeDetail(_Out):
    id: int
    parent: int | None
    start: int
    end: int
    trained: int
    state: NodeStateName
    progress: float | None
    schedule: str
    checkpoints: list[int]
    evals: dict[str, Metrics] = Field(description="step -> evaluation metrics at it")
    curve_points: int
    path_changes: list[dict[str, Any]]
    children: list[int]
    trial_count: int
    trials: list[NodeTrial]


class SlotStudy(_Out):
    id: str
    name: str
    trials: list[str]
    trial_count: int


class SlotWork(_Out):
    busy: bool
    sent_ahead: bool
    batch_id: int | None = None
    attempt: int | None = None
    started: bool | None = None
    studies: list[SlotStudy] | None = None
    nodes: list[int] | None = None
    start: int | None = None
    end: int | None = None
    step: int | None = None
    log: bool | None = Field(None, description="whether this master can read its worker's log")


class SlotOut(_Out):
    id: str
    gpu_type: str
    gpu_index: int
    share: float
    cpu_cores: int
    work: SlotWork | None = Field(description="the batch occupying it (another owner's: only busy)")
    next: list[SlotWork] = Field(description="batches sent to it ahead, to start when it frees")


class HostOut(_Out):
    id: str
    address: str
    state: str
    last_heartbeat: float
    slots: list[SlotOut]
    gpus: list[dict[str, Any]]


class ClusterSummary(_Out):
    slots: int
    busy: int
    sent_ahead: int


class History(_Out):
    t0: float
    t1: float
    bucket_s: float
    busy: list[float] = Field(description="mean busy slots in each bucket from t0")
    slots: int


class FailureRow(_Out):
    study_id: str
    study: str
    trial: str
    request_id: int
    step: int
    headline: str
    log_path: str
    node_manager: str
    batch_id: int | None
    at: float | None


class Decision(_Out):
    study_id: str
    study: str
    kind: Literal["kill", "preempt"]
    what: str
    reason: str


class Cluster(_Out):
    node_managers: list[HostOut]
    summary: ClusterSummary
    history: History
    failures: list[FailureRow]
    decisions: list[Decision]


class LogFile(_Out):
    path: str
    bytes: int
    text: str
    truncated: bool
    error: str


class TrainerLine(_Out):
    seq: int = Field(description="the line's place among its batch attempt's lines")
    node: int
    step: int
    at: float = Field(description="when the trainer logged it (epoch seconds, its host's clock)")
    line: str


class WorkerLog(_Out):
    batch_id: int
    attempt: int
    node_manager: str
    files: list[LogFile]
    readable: bool
    where: str = Field(description="where the log is when this master cannot read it")
    host: str = Field("", description="the address of the node manager's host, as it registered")
    path: str = Field(
        "",
        description="the log file on that host: its whole path when the node manager said it (a failed "
        "attempt's error), else relative to the node manager's work directory (STAGETREE_NM_WORK_DIR)",
    )
    lines: list[TrainerLine] = Field(
        default_factory=list,
        description="the text lines the attempt's trainer logged (self.log_text): kept by the master, so "
        "shown in every mode (at most core.loglines.MAX_LINES per attempt)",
    )
