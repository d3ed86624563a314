"""``POST /taco-notebook/api/clusters/{id}/peek``: an expression read from a kernel's cluster while it runs a cell,
through a real Jupyter server; bad bodies name their field; without Jupyter's ``execute`` permission, a 403."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from jupyter_server.auth.authorizer import Authorizer
from pytest_jupyter.jupyter_server import *  # noqa: F403  (fixtures: jp_fetch, jp_serverapp, ...)
from traitlets.config import Config

from taco_notebook.cluster.registry.writer import track
from taco_notebook.cluster.session import TacoCluster

from .test_server import Fetch, api, manager, registry_dir  # noqa: F401  (fixtures)


class NoExecute(Authorizer):
    """Every action on clusters, but no one may execute code in kernels."""

    def is_authorized(self, handler: Any, user: Any, action: str, resource: str) -> bool:
        return action != "execute"


@pytest.fixture
def authorizer_class() -> type[Authorizer] | None:
    return None


@pytest.fixture
def jp_server_config(registry_dir: Path, authorizer_class: type[Authorizer] | None) -> Config:  # noqa: F811
    server: dict[str, Any] = {"jpserver_extensions": {"taco_notebook": True}}
    if authorizer_class is not None:
        server["authorizer_class"] = authorizer_class
    return Config({"ServerApp": server})


@pytest.mark.cluster
def test_peek_reads_a_running_cells_variable_from_every_rank(api: Fetch, tmp_path: Path) -> None:  # noqa: F811
    flag = tmp_path / "release"
    cluster = track(TacoCluster("peeksrv", 2))
    try:
        cluster.start()
        cell = (f"import os, time\ncount = 0\nwhile not os.path.exists({str(flag)!r}):\n"
                "    count += 1\n    time.sleep(0.01)\ncount > 0")
        result = cluster.client[cluster.engine_ids()].execute(cell, block=False)
        try:
            deadline = time.monotonic() + 60
            while True:
                code, reply = api("POST", "clusters", cluster.cluster_id, "peek", body={"expr": "count > 0"})
                if code != 200 or time.monotonic() > deadline or reply["text"].endswith("ranks 0, 1: True"):
                    break
                time.sleep(0.2)
            asked = api("POST", "clusters", cluster.cluster_id, "peek",
                        body={"expr": "taco.rank() + 100", "ranks": [1], "timeout": 0.5})
            refused = [api("POST", "clusters", cluster.cluster_id, "peek", body=body) for body in (
                {}, {"expr": "1", "ranks": [5]}, {"expr": "1", "timeout": 60}, {"expr": "1", "ranks": "all"})]
        finally:
            flag.touch()
            result.get(60)
        assert code == 200 and reply["ranks"] == [{"rank": 0, "value": "True"}, {"rank": 1, "value": "True"}], reply
        assert asked[0] == 200 and asked[1]["ranks"] == [{"rank": 1, "value": "101"}]
        assert [status for status, _ in refused] == [400, 400, 400, 400]
        messages = [body["message"] for _, body in refused]
        assert "field 'expr' is required" in messages[0]
        assert f"cluster {cluster.cluster_id} has no rank [5]" in messages[1]
        assert "field 'timeout' must be seconds in (0, 5]" in messages[2]
        assert "field 'ranks' must be a non-empty list" in messages[3]
    finally:
        cluster.stop()
    code, reply = api("POST", "clusters", cluster.cluster_id, "peek", body={"expr": "1"})
    assert code == 404 and "No such cluster" in reply["message"]


@pytest.mark.parametrize("authorizer_class", [NoExecute])
def test_peek_needs_the_execute_permission(api: Fetch) -> None:  # noqa: F811
    code, reply = api("POST", "clusters", "any-1", "peek", body={"expr": "1"})
    assert code == 403, reply
    assert api("GET", "clusters")[0] == 200  # reading clusters is still allowed
