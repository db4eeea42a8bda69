"""A trial's next batch goes to the slot whose worker trained it last (``RoundInput.warm``): there the
worker continues from the trainer in memory. Two CPU slots; a long trial takes the first slot, a short one
the second; once both are done, both slots are free and the short trial's continuation still goes to the
second slot, where first fit alone would have taken the first."""

from __future__ import annotations

import asyncio
from pathlib import Path

import stagetree
from stagetree.nodemanager.examples.digits import ENTRY_POINT
from tests.integration.embedded.test_policies_live import cluster_and_client, settled

VALUES = {"hidden": 16, "minibatches": 2}


async def test_a_continuation_runs_on_the_slot_that_trained_its_trial(tmp_path: Path) -> None:
    async with cluster_and_client(tmp_path / "home", workers=2) as (cluster, client):
        await cluster.workers_ready()
        study = await stagetree.Study.create(
            client, "warm", trainer=ENTRY_POINT, seed=3, values=VALUES, tuned=["lr", "bs"]
        )
        long, short = {"lr": 0.1, "bs": 32}, {"lr": 0.05, "bs": 32}
        await asyncio.wait_for(asyncio.gather(study.eval(long, 30), study.eval(short, 6)), 180)
        first = await settled(cluster, study.id)
        slot_of = {end: slot for _, _, _, _, end, slot in first}
        assert (slot_of[30], slot_of[6]) == ("cpu0", "cpu1"), first  # side by side, the longest first
        await asyncio.wait_for(study.eval(short, 12), 180)
        after = await settled(cluster, study.id)
        (cont,) = [row for row in after if row[4] == 12]
        assert cont[5] == "cpu1", after  # first fit alone: cpu0, the first free slot
