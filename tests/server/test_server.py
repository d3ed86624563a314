"""The REST API of the server extension, against a real Jupyter server (pytest-jupyter) and real clusters.

pytest-jupyter's fixtures are imported here rather than loaded with ``pytest_plugins``: a plugin's autouse
fixtures (a fresh event loop and a ServerApp cleanup around every test) would otherwise apply to the whole suite.
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import tornado.web
from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from pytest_jupyter.jupyter_server import *  # noqa: F403  (fixtures: jp_fetch, jp_serverapp, ...)
from tornado.httpclient import HTTPClientError
from traitlets.config import Config

import taco_notebook
from taco_notebook.cluster.launch.limits import max_ranks
from taco_notebook.cluster.registry import files as registry
from taco_notebook.cluster.registry.writer import track
from taco_notebook.cluster.session import TacoCluster
from taco_notebook.server import MANAGER_SETTING, handlers
from taco_notebook.server.manager import ClusterManager

from ..cluster.registry import test_registry
from ..cluster.registry.test_registry import dead_pid, make_entry, wait_for

sleeper = test_registry.sleeper  # a fixture: processes that stand in for a dead kernel's leftovers

API = "taco-notebook/api"
Fetch = Callable[..., tuple[int, Any]]


@pytest.fixture
def registry_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "registry"
    monkeypatch.setenv(registry.ENV_VAR, str(directory))
    return directory


@pytest.fixture
def jp_server_config(registry_dir: Path) -> Config:
    return Config({"ServerApp": {"jpserver_extensions": {"taco_notebook": True}}})


@pytest.fixture
def manager(jp_serverapp: Any) -> Iterator[ClusterManager]:
    """The extension's manager; stops the clusters the server started even when the test fails."""
    made: ClusterManager = jp_serverapp.web_app.settings[MANAGER_SETTING]
    yield made
    made.shutdown()


@pytest.fixture
def api(jp_fetch: Any, jp_asyncio_loop: Any, manager: ClusterManager) -> Fetch:
    """``api("GET", "clusters")`` -> (status, decoded JSON body), errors included (no raise)."""

    def call(method: str, *parts: str, body: Any = None, **kwargs: Any) -> tuple[int, Any]:
        if body is not None and not isinstance(body, bytes | str):
            body = json.dumps(body)
        try:
            response = jp_asyncio_loop.run_until_complete(
                jp_fetch(API, *parts, method=method, body=body, allow_nonstandard_methods=True, **kwargs))
        except HTTPClientError as exc:
            assert exc.response is not None
            response = exc.response
        return response.code, json.loads(response.body) if response.body else None

    return call


def test_version_and_empty_list(api: Fetch) -> None:
    # the version also says how many ranks a cluster may have, for the sidebar's dialog
    assert api("GET", "version") == (200, {"version": taco_notebook.__version__, "max_ranks": max_ranks()})
    assert api("GET", "clusters") == (200, {"clusters": []})


@pytest.mark.parametrize(("method", "body", "status", "words"), [
    ("POST", b"{oops", 400, "JSON object"),
    ("POST", {"size": "x"}, 400, "'size' must be a positive integer, got \"x\""),
    ("POST", {"size": 0}, 400, "'size' must be a positive integer, got 0"),
    ("POST", {}, 400, "'size' is required"),
    ("POST", {"size": 1, "gpus": 2}, 400, "unknown field(s) 'gpus'"),
])
def test_bad_bodies_are_400_naming_the_field(api: Fetch, method: str, body: Any, status: int, words: str) -> None:
    code, reply = api(method, "clusters", body=body)
    assert code == status
    assert set(reply) == {"message", "reason"} and words in reply["message"] and words in reply["reason"]
    assert api("GET", "clusters") == (200, {"clusters": []})


def test_unknown_cluster_is_404(api: Fetch) -> None:
    for method, body in (("GET", None), ("DELETE", None), ("PATCH", {"size": 2})):
        assert api(method, "clusters", "no-such-id", body=body) == (
            404, {"message": "No such cluster: no-such-id", "reason": "No such cluster: no-such-id"})


def test_unauthenticated_requests_are_rejected(jp_asyncio_loop: Any, http_server_client: Any, jp_base_url: str,
                                              api: Fetch) -> None:
    for headers in ({}, {"Authorization": "token wrong"}):
        for method, body in (("GET", None), ("POST", b'{"size": 1}'), ("DELETE", None)):
            url = url_path_join(jp_base_url, API, "clusters" if method != "DELETE" else "clusters/x")
            response = jp_asyncio_loop.run_until_complete(
                http_server_client.fetch(url, method=method, body=body, headers=headers, raise_error=False,
                                         allow_nonstandard_methods=True))
            assert response.code in (401, 403), (method, headers, response.code)
    assert api("GET", "clusters") == (200, {"clusters": []})


def test_every_handler_verb_is_authenticated_authorized_and_async() -> None:
    """Walk the handler classes: each HTTP verb they define must be wrapped by tornado.web.authenticated, then by
    jupyter_server's ``authorized`` (the action from the HTTP method, as for kernels), over a coroutine."""
    wrapper_code = tornado.web.authenticated(lambda self: None).__code__
    authorized_code = authorized(lambda self: None).__code__
    classes = [c for _, c in inspect.getmembers(handlers, inspect.isclass)
               if issubclass(c, APIHandler) and c.__module__ == handlers.__name__]
    verbs = [(c.__name__, verb) for c in classes for verb in ("get", "post", "put", "patch", "delete", "head")
             if getattr(c, verb) is not getattr(tornado.web.RequestHandler, verb)]
    assert len(verbs) >= 6
    for name, verb in verbs:
        method = getattr(getattr(handlers, name), verb)
        assert method.__code__ is wrapper_code, f"{name}.{verb} lacks @tornado.web.authenticated"
        assert method.__wrapped__.__code__ is authorized_code, f"{name}.{verb} lacks @authorized under it"
        assert inspect.iscoroutinefunction(inspect.unwrap(method)), f"{name}.{verb} is not async"
        assert getattr(handlers, name).auth_resource == handlers.AUTH_RESOURCE


@pytest.mark.cluster
def test_kernel_cluster_is_listed_and_stopped_through_its_kernel(api: Fetch) -> None:
    cluster = track(TacoCluster("srvtest", 2))
    try:
        cluster.start()
        code, listing = api("GET", "clusters")
        [model] = listing["clusters"]
        assert (code, model["id"], model["name"], model["state"]) == (200, cluster.cluster_id, "srvtest", "running")
        assert (model["size"], model["engines_up"], model["owner"]["kind"]) == (2, 2, "kernel")
        assert [(n["node"], n["ranks"]) for n in model["nodes"]] == [(0, [0, 1])]
        assert model["gpus"] == sum(n["gpus"] for n in model["nodes"]) and model["mpi"]
        assert api("GET", "clusters", model["id"]) == (200, model)

        code, answer = api("DELETE", "clusters", model["id"])
        assert code == 202 and answer["pending"]["action"] == "stop"
        wait_for(lambda: api("GET", "clusters", model["id"])[0] == 404, what="the kernel to stop it")
        assert cluster.ipp_cluster is None
    finally:
        cluster.stop()


@pytest.mark.cluster
def test_server_cluster_start_scale_stop(api: Fetch) -> None:
    """One cluster through its whole life: POST, PATCH, DELETE (each start is a real MPI job)."""
    code, model = api("POST", "clusters", body={"size": 1, "name": "viarest"})
    assert (code, model["state"], model["owner"]["kind"], model["name"]) == (202, "starting", "server", "viarest")
    cluster_id = model["id"]

    def state() -> dict[str, Any]:
        return api("GET", "clusters", cluster_id)[1]

    running = wait_for(lambda: (m := state())["state"] == "running" and m, 120, "the start")
    assert (running["size"], running["engines_up"], running["error"]) == (1, 1, None)
    assert api("PATCH", "clusters", cluster_id, body={"size": 1})[0] == 409

    code, answer = api("PATCH", "clusters", cluster_id, body={"size": 2})
    assert code == 202 and answer["pending"]["action"] == "scale" and answer["pending"]["size"] == 2
    scaled = wait_for(lambda: (m := state())["state"] == "running" and m["size"] == 2 and m, 120, "the scale")
    assert scaled["engines_up"] == 2 and scaled["id"] == cluster_id
    assert [m["id"] for m in api("GET", "clusters")[1]["clusters"]] == [cluster_id]

    assert api("DELETE", "clusters", cluster_id)[0] == 202
    wait_for(lambda: api("GET", "clusters", cluster_id)[0] == 404, 60, "the stop")
    assert api("GET", "clusters") == (200, {"clusters": []})


def test_stale_entry_is_shown_and_deletable(api: Fetch, registry_dir: Path,
                                            sleeper: Callable[..., psutil.Process]) -> None:
    left = sleeper("old-1")  # a process of the dead kernel's cluster, still running
    make_entry(registry_dir, "old-1", *dead_pid(), processes=[(left.pid, left.create_time())])
    code, listing = api("GET", "clusters")
    assert code == 200 and [m["state"] for m in listing["clusters"]] == ["stale"]
    assert "1 process it started is still running: Stop kills it" in listing["clusters"][0]["error"]
    code, reply = api("PATCH", "clusters", "old-1", body={"size": 2})
    assert code == 409 and "stale" in reply["message"]
    assert api("DELETE", "clusters", "old-1")[0] == 202
    left.wait(10)
    assert api("GET", "clusters") == (200, {"clusters": []})


@pytest.mark.cluster
def test_extension_shutdown_stops_the_servers_cluster(api: Fetch, jp_serverapp: Any, jp_asyncio_loop: Any,
                                                      manager: ClusterManager, registry_dir: Path) -> None:
    """A cluster started through the API is served as it models itself and as its registry file holds
    it; the server's shutdown (jupyter_server's cleanup_extensions → the extension app's stop_extension, not
    atexit) stops it: its processes are gone and its entry removed."""
    code, model = api("POST", "clusters", body={"size": 2, "name": "unload"})
    assert code == 202 and model["state"] == "starting"
    cluster_id = model["id"]
    running = wait_for(lambda: (m := api("GET", "clusters", cluster_id)[1])["state"] == "running" and m, 120,
                       "the start")
    cluster = manager._clusters[cluster_id]
    # the entry is written on the "running" event, a moment after the cluster says it runs
    on_file = wait_for(lambda: (m := registry.read_model(registry_dir, cluster_id)) and m["state"] == "running"
                       and m, 10, "the running entry")
    assert on_file["this_server"] is False and running["this_server"] is True
    for other in (cluster.model(), on_file):
        assert {**running, "updated_at": 0, "this_server": False} == {**other, "updated_at": 0}
    pids = [p.pid for p in cluster.processes]
    assert len(pids) >= 3  # controller, mpiexec, ranks

    jp_asyncio_loop.run_until_complete(jp_serverapp.cleanup_extensions())
    assert test_registry.wait_for_gone(pids) == []
    assert cluster.state == "stopped" and manager._clusters == {}
    assert not (registry_dir / f"{cluster_id}.json").exists()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.cluster
def test_a_jupyter_server_stopped_by_sigterm_stops_its_cluster(tmp_path: Path) -> None:
    """As a user's server goes: ``jupyter server`` (a real process, the extension loaded from its
    config) starts a cluster for the sidebar; SIGTERM (what a service manager sends) ends the server, and on its
    way out the extension app's stop_extension stops the cluster: no process of it left, no entry."""
    port, token, directory = _free_port(), "t" + os.urandom(8).hex(), tmp_path / "registry"
    env = {**os.environ, "TACO_REGISTRY_DIR": str(directory), "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")}
    log = tmp_path / "server.log"  # a file, not a pipe: a full pipe nobody reads would stall the server
    with open(log, "w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "jupyter_server", f"--port={port}", "--ip=127.0.0.1", "--no-browser",
             f"--IdentityProvider.token={token}", "--ServerApp.jpserver_extensions={'taco_notebook': True}",
             f"--ServerApp.root_dir={tmp_path}", *(["--allow-root"] if os.geteuid() == 0 else [])],
            env=env, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}/taco-notebook/api/clusters"

    def call(method: str, url: str, body: Any = None) -> Any:
        request = urllib.request.Request(url, method=method, data=json.dumps(body).encode() if body else None,
                                         headers={"Authorization": f"token {token}"})
        with urllib.request.urlopen(request, timeout=10) as reply:
            return json.loads(reply.read())

    def answers() -> bool:
        try:
            return call("GET", base) is not None
        except OSError:
            return False

    try:
        wait_for(answers, 60, "the server to answer")
        cluster_id = call("POST", base, {"size": 1, "name": "sigterm"})["id"]
        wait_for(lambda: call("GET", f"{base}/{cluster_id}")["state"] == "running", 120, "the start")
        # the entry is written on the "running" event, a moment after the cluster says it runs
        entry = wait_for(lambda: (e := registry.read_entry(directory, cluster_id)) and e["model"]["state"]
                         == "running" and e, 10, "the running entry")
        assert entry["model"]["owner"]["pid"] == server.pid
        pids = [pid for pid, _ in entry["processes"]]
        assert len(pids) >= 3
        server.send_signal(signal.SIGTERM)
        assert server.wait(120) == 0, log.read_text()[-3000:]
        assert test_registry.wait_for_gone(pids) == [], log.read_text()[-3000:]
        assert not (directory / f"{cluster_id}.json").exists()
        text = log.read_text()  # the cluster stopped within jupyter_server's cleanup of its extensions
        assert 0 <= text.find(" extensions\n") < text.find("taco_notebook: stopped the clusters this server started"), \
            text[-3000:]
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(30)
