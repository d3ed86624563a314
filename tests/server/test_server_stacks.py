"""``GET /taco-notebook/api/clusters/{id}/stacks``: the hang autopsy through a real Jupyter server, read from a
kernel's cluster while that cluster runs a cell (the server needs neither the kernel nor the ranks' main threads)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from pytest_jupyter.jupyter_server import *  # noqa: F403  (fixtures: jp_fetch, jp_serverapp, ...)

from taco_notebook.cluster.registry.writer import track
from taco_notebook.cluster.session import TacoCluster

from ..cluster.registry import test_registry
from ..cluster.registry.test_registry import dead_pid, make_entry
from .test_server import Fetch, api, jp_server_config, manager, registry_dir  # noqa: F401  (fixtures)

sleeper = test_registry.sleeper  # a fixture: processes that stand in for a dead kernel's leftovers


@pytest.mark.cluster
def test_stacks_of_a_kernel_cluster_while_a_rank_hangs(api: Fetch, tmp_path: Path) -> None:  # noqa: F811
    flag = tmp_path / "release"
    cluster = track(TacoCluster("stackssrv", 2))
    try:
        cluster.start()
        cell = (f"import os, time\nt = torch.ones(1)\nif taco.rank() == 1:\n"
                f"    while not os.path.exists({str(flag)!r}):\n        time.sleep(0.05)\n"
                "taco.allreduce(t, name='step')")
        result = cluster.client[cluster.engine_ids()].execute(cell, block=False)
        try:
            deadline = time.monotonic() + 60
            while True:
                code, report = api("GET", "clusters", cluster.cluster_id, "stacks")
                # rank 1 in its wait loop (line 5), not on its way there while rank 0 already waits
                if code != 200 or time.monotonic() > deadline or report["suspects"] == [1] and any(
                        r["rank"] == 1 and r["summary"].startswith("cell:5 ") for r in report["ranks"]):
                    break
                time.sleep(0.2)
        finally:
            flag.touch()
            result.get(60)
        assert code == 200, report
        assert report["suspects"] == [1], report["text"]
        by_rank = {r["rank"]: r for r in report["ranks"]}
        assert by_rank[0]["collective"]["name"] == "allreduce 'step'" and by_rank[1]["collective"] is None
        assert by_rank[1]["summary"] == "cell:5 in <module>, no collective", report["text"]
        assert re.search(r"^rank 0: allreduce #\d+ 'step' \(waited \d+\.\d s\) at cell:6 in <module>$", report["text"],
                         re.M), report["text"]
        assert by_rank[0]["pid"] == next(r.pid for r in cluster.ranks if r.rank == 0)
    finally:
        cluster.stop()
    code, reply = api("GET", "clusters", cluster.cluster_id, "stacks")
    assert code == 404 and "No such cluster" in reply["message"]


def test_stacks_of_a_stale_or_unknown_cluster_are_refused(api: Fetch, registry_dir: Path,  # noqa: F811
                                                          sleeper: Callable[..., psutil.Process]) -> None:
    left = sleeper("old-2")  # a process of the dead kernel's cluster, still running: the entry is stale
    make_entry(registry_dir, "old-2", *dead_pid(), processes=[(left.pid, left.create_time())])
    code, reply = api("GET", "clusters", "old-2", "stacks")
    assert code == 409 and "cluster old-2 is stale: it has no ranks to read stacks from" in reply["message"]
    assert api("GET", "clusters", "nope", "stacks")[0] == 404
