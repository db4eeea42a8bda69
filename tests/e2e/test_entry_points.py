"""A trainer entry point whose module lacks the class (``module:Missing``) on the process cluster: a clear
error, as in embedded mode, whether the client sees the module (refused at creation) or only the node
managers do (the first eval fails at once, naming the module's file and its Trainer classes, with no
traceback of stagetree's frames), never a hang."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from stagetree.client.sdk import Client, EvalFailed, Study
from stagetree.cluster import ProcessCluster
from stagetree.core.errors import InvalidArgument
from tests.e2e.helpers import batches, plan_of, requests

pytestmark = pytest.mark.slow


async def test_a_class_its_module_lacks_is_a_clear_error_on_the_cluster(
    cluster: ProcessCluster, client: Client
) -> None:
    with pytest.raises(InvalidArgument, match="defines no 'Missing'"):  # the client reads the module's source
        await Study.create(
            client, "missing-here", trainer="stagetree.nodemanager.examples.digits:Missing", tuned=["lr"]
        )

    # a module in the node managers' working directory: on their workers' path, not on the client's
    module = f"cluster_only_{uuid.uuid4().hex[:8]}"
    source = cluster.root / f"{module}.py"
    source.write_text("from stagetree.nodemanager.examples.digits import DigitsMLP as Net\n")
    study = await Study.create(
        client, f"missing-there-{module}", trainer=f"{module}:Missing", dataset="sklearn-digits", tuned=["lr"]
    )
    with pytest.raises(EvalFailed) as err:
        await asyncio.wait_for(study.eval({"lr": 0.1}, 3), 60)
    message = err.value.message
    assert (
        f"trainer entry point '{module}:Missing': module {module} ({source}) has no 'Missing'; its Trainer classes: Net"
        in message
    ), message
    assert "Traceback" not in message and "worker log: " in message, message
    ((_, state, failures, _, _, _),) = requests(cluster, study)
    assert state == "FAILED" and failures == 1  # at once: a retry would find no such class either
    assert [b.state for b in batches(cluster, plan_of(cluster, study))] == ["FAILED"]
