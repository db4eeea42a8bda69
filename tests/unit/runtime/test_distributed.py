"""A batch on several ranks: the rank description, the backend choice, and real groups of worker
processes (gloo on the CPU) that train data-parallel, checkpoint every rank's random streams and resume
exactly; a failing rank's peers stop with a failure that is not the user's."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from stagetree.core.batch import BatchSpec, Point, Source
from stagetree.core.errors import FailedPrecondition, InvalidArgument
from stagetree.nodemanager.examples.digits import DigitsMLP, digits_batch
from stagetree.nodemanager.examples.faults import TORCH_ENTRY_POINT
from stagetree.nodemanager.examples.torch_digits import ENTRY_POINT as TORCH_DIGITS
from stagetree.nodemanager.examples.torch_digits import DigitsTorch
from stagetree.nodemanager.runtime.checkpoints import LocalCheckpointStore
from stagetree.nodemanager.runtime.distributed import backend_for, is_peer_lost
from stagetree.nodemanager.runtime.ranks import PEER_LOST_NOTE, RankInfo
from stagetree.nodemanager.runtime.state import RUNTIME_FILE, Restored, restore, restore_checkpoint, take_snapshot
from stagetree.nodemanager.runtime.trainer import TrainerContext, capture_rng_state
from tests.unit.runtime.ranks import RanksRun, run_ranks

pytestmark = pytest.mark.timeout(240)

HP = {"lr": 0.1, "momentum": 0.9, "bs": 32}
NOISY = {"dropout": 0.3, "rank_noise": True}  # the ranks' random streams differ (see FaultyTorchDigits)


def _spec(
    start: int, end: int, *, batch_id: int, source: Source | None = None, fixed: Mapping[str, object] | None = None
) -> BatchSpec:
    return digits_batch(
        [(1, start, end, HP)],
        batch_id=batch_id,
        seed=3,
        trainer=TORCH_ENTRY_POINT,
        fixed_values=dict(fixed or {}),
        source=source,
        evals=[(1, end)],
        saves=[(1, end)],
    )


# -- the pieces ------------------------------------------------------------------------------------


def test_rank_info_round_trips_and_names_the_torch_variables() -> None:
    info = RankInfo(1, 2, 1, "127.0.0.1", 29511)
    assert RankInfo.from_json(info.to_json()) == info
    assert info.env() == {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29511",
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "2",
    }
    assert info.distributed and not info.leader
    assert RankInfo.of_extra({}) == RankInfo() and not RankInfo().distributed
    with pytest.raises(InvalidArgument):
        RankInfo(2, 2, 0, "127.0.0.1", 29511)
    with pytest.raises(InvalidArgument, match="rendezvous port"):
        RankInfo(0, 2, 0, "127.0.0.1", 0)
    with pytest.raises(InvalidArgument):
        RankInfo.from_json({"rank": 0})


def test_backend_is_nccl_for_cuda_ranks_when_torch_has_it_and_gloo_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    assert backend_for(torch.device("cpu")) == "gloo"
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert backend_for(torch.device("cuda", 0)) == "nccl"
    assert backend_for(torch.device("cpu")) == "gloo"
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    assert backend_for(torch.device("cuda", 0)) == "gloo"


def test_a_failed_collective_is_told_apart_from_other_errors() -> None:
    assert is_peer_lost(RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1"))
    try:
        try:
            raise RuntimeError("Connection reset by peer")
        except RuntimeError as e:
            raise ValueError("in the user's step") from e
    except ValueError as wrapped:
        assert is_peer_lost(wrapped)
    assert not is_peer_lost(ValueError("bad lr"))
    assert not is_peer_lost(RuntimeError("CUDA out of memory"))


def test_the_slots_of_a_spec_travel_in_its_json_and_one_slot_reads_as_before() -> None:
    spec = _spec(0, 4, batch_id=1)
    assert "slots" not in spec.to_json() and BatchSpec.from_json(spec.to_json()).slots == 1
    two = dataclasses.replace(spec, slots=2)
    assert BatchSpec.from_json(two.to_json()).slots == 2
    with pytest.raises(InvalidArgument, match="slots"):
        dataclasses.replace(spec, slots=0)


def test_a_checkpoint_of_two_ranks_resumes_on_one_only_when_the_trainer_says_it_may(tmp_path: Path) -> None:
    store = LocalCheckpointStore(tmp_path / "ckpt", fsync=False)
    ranks = [capture_rng_state(), capture_rng_state()]
    for cls in (DigitsTorch, DigitsMLP):
        t = cls()
        t.bind(TrainerContext(seed=0))
        t.init()
        snap = take_snapshot(t, Point(1, 5), ranks)
        uri = store.put(f"p/{cls.__name__}", snap.write).uri
        fresh = cls()
        fresh.bind(TrainerContext(seed=0))
        fresh.init()
        if cls.rescalable:  # and the worker learns it resumed 2 ranks' checkpoint, to report it
            assert restore_checkpoint(fresh, store, uri, 0, 1) == Restored(Point(1, 5), 2)
        else:
            with pytest.raises(FailedPrecondition, match="written by 2 rank"):
                restore(fresh, store, uri, 0, 1)
        assert restore(fresh, store, uri, 1, 2) == Point(1, 5)  # the same number of ranks: always


# -- real groups -----------------------------------------------------------------------------------


def test_two_ranks_resume_exactly_on_two_ranks(tmp_path: Path) -> None:
    """12 steps straight == 6 steps, a checkpoint, and 6 more from it on a new group; the ranks' random
    streams differ, and the resume is exact only with each rank's own (a checkpoint that gives rank 1
    rank 0's streams resumes to other metrics)."""
    root = tmp_path / "ckpt"
    straight = run_ranks(_spec(0, 12, batch_id=1, fixed=NOISY), 2, root, tmp_path / "w")
    assert straight.codes == [0, 0], straight.log_tails()
    first = run_ranks(_spec(0, 6, batch_id=2, fixed=NOISY), 2, root, tmp_path / "w")
    ck = first.checkpoint_at(6)
    assert [k for k, _ in first.rank_events[1]] == []  # rank 1 reports nothing when all goes well
    second = run_ranks(
        _spec(6, 12, batch_id=3, source=Source(Point(1, 6), ck["uri"]), fixed=NOISY), 2, root, tmp_path / "w"
    )
    assert second.codes == [0, 0], second.log_tails()
    assert second.metrics_at(12) == straight.metrics_at(12)

    store = LocalCheckpointStore(root, fsync=False)
    with store.open(ck["uri"]) as d:
        rt = torch.load(d / RUNTIME_FILE, weights_only=True)
    r0, r1 = rt["rng_ranks"]
    assert not torch.equal(r0["torch"], r1["torch"])  # the ranks' streams differ ...
    rt["rng_ranks"] = [r0, r0]  # ... so a resume that gave rank 1 rank 0's would not be exact
    with store.open(ck["uri"]) as d:
        files = {p.relative_to(d): p.read_bytes() for p in d.rglob("*") if p.is_file()}

    def forged(directory: Path) -> None:
        for rel, data in files.items():
            (directory / rel).parent.mkdir(parents=True, exist_ok=True)
            (directory / rel).write_bytes(data)
        torch.save(rt, directory / RUNTIME_FILE)

    wrong = store.put("forged/s6", forged).uri
    other = run_ranks(_spec(6, 12, batch_id=4, source=Source(Point(1, 6), wrong), fixed=NOISY), 2, root, tmp_path / "w")
    assert other.metrics_at(12) != straight.metrics_at(12)


def test_two_ranks_train_like_one_rank_on_the_same_global_batch(tmp_path: Path) -> None:
    """Data parallel on 2 ranks takes the same steps as 1 rank with the same global minibatch: the
    gradient is the mean of the two halves' (weighted by their rows), the same number summed in another
    order, so the two runs differ only by float rounding carried along (measured: about 1e-7 on the loss
    after 20 steps); 1e-5 leaves room for other BLAS builds and still catches any real difference (a
    wrong shard, an unweighted mean of uneven halves: 1e-3 and more)."""
    root = tmp_path / "ckpt"
    hp = {"lr": 0.1, "momentum": 0.9, "bs": 33}  # odd: the halves are uneven (17 and 16 rows)
    spec = digits_batch([(1, 0, 20, hp)], seed=5, trainer=TORCH_DIGITS, evals=[(1, 20)], saves=[(1, 20)])
    one = run_ranks(spec, 1, root, tmp_path / "w1")
    two = run_ranks(dataclasses.replace(spec, batch_id=2), 2, root, tmp_path / "w2")
    assert one.codes == [0] and two.codes == [0, 0], two.log_tails()
    m1, m2 = one.metrics_at(20), two.metrics_at(20)
    assert abs(m1["loss"] - m2["loss"]) <= 1e-5, (m1, m2)
    assert m1["accuracy"] == m2["accuracy"]
    curve1 = [p for c in one.of("curve") for p in c["points"]]
    curve2 = [p for c in two.of("curve") for p in c["points"]]
    assert [s for s, _ in curve1] == [s for s, _ in curve2]
    assert max(abs(a["loss"] - b["loss"]) for (_, a), (_, b) in zip(curve1, curve2, strict=True)) <= 1e-5


def test_periodic_checkpoints_by_steps_fall_on_the_same_steps_as_on_one_rank(tmp_path: Path) -> None:
    spec = dataclasses.replace(_spec(0, 10, batch_id=1), peripheral_every_steps=3)
    one = run_ranks(spec, 1, tmp_path / "ckpt", tmp_path / "w1")
    two = run_ranks(dataclasses.replace(spec, batch_id=2), 2, tmp_path / "ckpt", tmp_path / "w2")
    assert two.codes == [0, 0], two.log_tails()

    def saved(run: RanksRun) -> list[tuple[int, str]]:
        return [(p["step"], p["kind"]) for p in run.of("checkpoint_saved")]

    assert saved(two) == saved(one) == [(3, "peripheral"), (6, "peripheral"), (9, "peripheral"), (10, "central")]


def test_a_rank_whose_code_raises_stops_its_peer_with_an_error_that_is_not_the_users(tmp_path: Path) -> None:
    spec = _spec(0, 30, batch_id=1, fixed={"fault": "raise", "fault_step": 3, "fault_rank": 1})
    run = run_ranks(spec, 2, tmp_path / "ckpt", tmp_path / "w", timeout_s=120)
    assert run.codes == [1, 1], run.log_tails()
    (own,) = [p for k, p in run.rank_events[1] if k == "batch_failed"]
    assert own["user_error"] and "injected fault in user code" in own["error"]
    (peer,) = run.of("batch_failed")
    assert not peer["user_error"] and not peer["oom"], peer["error"]
    assert peer["error"].startswith(PEER_LOST_NOTE), peer["error"]
