"""A study's time, as its stats report it, on the embedded cluster with real workers: six trials queued
behind one slot train one after another, so their training cannot add up to more than the study took
(counting from each batch's dispatch or send, as a queued batch would, adds up to about twice that); the
rest of their batches' lives (waiting for the slot, the workers' start-up, checkpoint I/O) is reported
apart."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import stagetree
from stagetree.embedded import Embedded, EmbeddedSettings
from stagetree.nodemanager.examples.faults import ENTRY_POINT

STEPS, SLEEP_S = 10, 0.05


async def test_trials_queued_behind_one_slot_count_their_training_as_compute_and_their_wait_apart(
    tmp_path: Path,
) -> None:
    configs = [{"lr": 0.02 * (i + 1)} for i in range(6)]  # no shared prefix: six batches
    async with (
        Embedded(EmbeddedSettings(home=tmp_path / "home", workers=1)) as cluster,
        stagetree.connect(cluster.target, token=cluster.token) as client,
    ):
        # every slot is sent its next batch at once (a lookahead longer than the study): each batch waits
        # on the node manager for the whole one before it, the time the stats must not count as compute
        scheduler = cluster.app.scheduler
        scheduler.settings = scheduler.settings.model_copy(update={"lookahead_s": 600.0})
        study = await stagetree.Study.create(
            client, "times", trainer=ENTRY_POINT, values={"sleep_s": SLEEP_S}, tuned=["lr"]
        )
        t0 = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*(study.eval(c, STEPS) for c in configs)), 240)
        wall = time.monotonic() - t0
        stats = await study.stats()
        executed = await asyncio.to_thread(cluster.app.store.batches.executed_steps)
    assert stats.steps_executed == executed == len(configs) * STEPS
    # one slot: the batches trained one at a time, within the study's time; what they waited is queueing
    assert len(configs) * STEPS * SLEEP_S <= stats.compute_seconds <= wall
    assert stats.queue_seconds > 0 and stats.startup_seconds > 0
