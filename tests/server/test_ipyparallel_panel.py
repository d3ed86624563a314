"""ipyparallel's own JupyterLab panel ("IPython Parallel") beside taco's: its server extension's REST API lists
the clusters and profiles it finds in IPython's ``profile_*`` directories, and taco's live elsewhere
(:mod:`taco_notebook.cluster.launch.ippfiles`), so the panel shows none of taco's clusters and no ``taco``
profile to start one in, while taco's own API lists the cluster and a stop leaves none of its files behind.
Both extensions in one real Jupyter server; a real MPI cluster started through taco's API."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pytest_jupyter.jupyter_server import *  # noqa: F403  (fixtures: jp_fetch, jp_serverapp, ...)
from traitlets.config import Config

from taco_notebook.cluster.launch import ippfiles

from ..cluster.registry.test_registry import wait_for
from .test_server import Fetch, api, manager, registry_dir  # noqa: F401  (fixtures)


@pytest.fixture
def ipython_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An IPython dir with the profile every user has (IPython makes ``profile_default`` on first start)."""
    directory = tmp_path / "ipython"
    (directory / "profile_default").mkdir(parents=True)
    monkeypatch.setenv("IPYTHONDIR", str(directory))
    return directory


@pytest.fixture
def jp_server_config(registry_dir: Path, ipython_dir: Path) -> Config:  # noqa: F811
    return Config({"ServerApp": {"jpserver_extensions": {"taco_notebook": True, "ipyparallel": True}}})


def ipyparallel_panel(jp_fetch: Any, jp_asyncio_loop: Any) -> list[dict[str, Any]]:
    """What ipyparallel's panel shows: its extension's ``GET /ipyparallel/clusters``."""
    response = jp_asyncio_loop.run_until_complete(jp_fetch("ipyparallel", "clusters"))
    return json.loads(response.body)


@pytest.mark.cluster
def test_ipyparallels_panel_lists_no_taco_cluster_and_no_taco_profile(api: Fetch, jp_fetch: Any,  # noqa: F811
                                                                       jp_asyncio_loop: Any) -> None:
    code, model = api("POST", "clusters", body={"size": 1, "name": "beside"})
    assert code == 202, model
    cluster_id = model["id"]
    wait_for(lambda: api("GET", "clusters", cluster_id)[1]["state"] == "running", 120, "the start")
    files = [path.name for path in ippfiles.cluster_files(cluster_id)]
    assert f"cluster-{cluster_id}.json" in files, files  # what a kernel attaches through

    listed = ipyparallel_panel(jp_fetch, jp_asyncio_loop)
    assert [(c["id"], c["cluster"]["profile"], c.get("controller")) for c in listed] == [("default:", "default", None)]

    assert api("DELETE", "clusters", cluster_id)[0] == 202
    wait_for(lambda: api("GET", "clusters", cluster_id)[0] == 404, 60, "the stop")
    assert ippfiles.cluster_files(cluster_id) == []
