"""Studies share a cluster: a study started while another has a long queue is served at once, not after
that queue (the round's fair share across owners and studies, ``core.round.order``), on the embedded mode
with real training."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import stagetree
from stagetree.core.sequences import Constant
from stagetree.embedded import Embedded, EmbeddedSettings
from stagetree.nodemanager.examples.faults import ENTRY_POINT

# 10 steps of at least 0.1 s each: a trial holds its slot for a second or more
VALUES = {"hidden": 16, "minibatches": 1, "sleep_s": 0.1}
STEPS = 10
FIRST_TRIALS = 24


async def test_a_study_started_behind_a_long_queue_is_served_before_that_queue_drains(tmp_path: Path) -> None:
    async with (
        Embedded(EmbeddedSettings(home=tmp_path / "home", workers=2)) as cluster,
        stagetree.connect(cluster.target, token=cluster.token) as client,
    ):
        first = await stagetree.Study.create(client, "first", trainer=ENTRY_POINT, seed=0, values=VALUES, tuned=["lr"])
        # distinct constant rates: no two trials share a step, so each is a batch of its own
        queue = [first.submit({"lr": Constant(round(0.01 + 0.01 * i, 3))}, STEPS) for i in range(FIRST_TRIALS)]
        done_first = 0

        async def count_first() -> None:
            nonlocal done_first
            for fut in asyncio.as_completed(queue):
                await fut
                done_first += 1

        counting = asyncio.create_task(count_first())
        deadline = time.monotonic() + 120
        while done_first < 2:  # the first study runs, its queue long behind it
            assert time.monotonic() < deadline, "the first study produced no result"
            await asyncio.sleep(0.05)

        second = await stagetree.Study.create(
            client, "second", trainer=ENTRY_POINT, seed=1, values=VALUES, tuned=["lr"]
        )
        late = [second.submit({"lr": Constant(lr)}, STEPS) for lr in (0.05, 0.2)]
        started_behind = FIRST_TRIALS - done_first
        await asyncio.wait_for(asyncio.gather(*late), 120)
        left_behind = FIRST_TRIALS - done_first
        # the second study's two trials took the next slots that freed, one after the other study's
        # batch each at most: most of the first study's queue is still waiting
        assert left_behind >= started_behind - 6, (started_behind, left_behind)
        assert left_behind >= FIRST_TRIALS // 2, (started_behind, left_behind)
        await asyncio.wait_for(counting, 180)
        assert done_first == FIRST_TRIALS
