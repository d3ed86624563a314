"""The REST handlers do their blocking work off the event loop, and a deployment's Authorizer decides
who may start, stop and scale clusters. A real Jupyter server (pytest-jupyter), as in test_server.py.

The slow read is real: the manager's registry read blocks its thread on an event only the test sets, as a hung
network disk would, while the server is left as it is. Were the handler to read on the event loop, the loop would
be stuck in that read and the second request could not be answered until the read gave up.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import psutil
import pytest
from jupyter_server.auth.authorizer import Authorizer
from pytest_jupyter.jupyter_server import *  # noqa: F403  (fixtures: jp_fetch, jp_serverapp, ...)
from traitlets import List
from traitlets.config import Config

import taco_notebook
from taco_notebook.cluster.registry import files as registry
from taco_notebook.server.handlers import AUTH_RESOURCE
from taco_notebook.server.manager import ClusterManager

from ..cluster.registry.test_registry import make_entry
from . import test_server
from .test_server import API, Fetch

api, manager, registry_dir = test_server.api, test_server.manager, test_server.registry_dir

HANG_S = 10.0  # how long the slow read waits for the test before it gives up (only if the loop was blocked)


class ReadOnlyClusters(Authorizer):
    """An Authorizer that lets every user read and no one write clusters, and keeps what it was asked."""

    asked = List()

    def is_authorized(self, handler: Any, user: Any, action: str, resource: str) -> bool:
        if resource == AUTH_RESOURCE:
            self.asked.append((handler.request.method, action))
        return action == "read" or resource != AUTH_RESOURCE


@pytest.fixture
def authorizer_class() -> type[Authorizer] | None:
    """The server's ``ServerApp.authorizer_class``: jupyter_server's default unless a test parametrizes it."""
    return None


@pytest.fixture
def jp_server_config(registry_dir: Path, authorizer_class: type[Authorizer] | None) -> Config:
    server: dict[str, Any] = {"jpserver_extensions": {"taco_notebook": True}}
    if authorizer_class is not None:
        server["authorizer_class"] = authorizer_class
    return Config({"ServerApp": server})


def test_a_slow_registry_read_leaves_the_server_answering(jp_fetch: Any, jp_asyncio_loop: Any, api: Fetch,
                                                          manager: ClusterManager,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """``GET clusters`` hangs in its registry read; meanwhile ``GET version`` is answered, and the listing
    completes, whole, once the read is let go."""
    entered, release, released = threading.Event(), threading.Event(), []
    read_models = registry.read_models

    def hung_read(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        released.append(release.wait(HANG_S))
        return read_models(*args, **kwargs)

    monkeypatch.setattr(registry, "read_models", hung_read)

    async def both() -> tuple[Any, bool, Any]:
        listing = asyncio.ensure_future(jp_fetch(API, "clusters"))
        assert await asyncio.to_thread(entered.wait, HANG_S), "GET clusters never reached the registry"
        version = await jp_fetch(API, "version")
        still_reading = not listing.done()
        release.set()
        return version, still_reading, await listing

    version, still_reading, listing = jp_asyncio_loop.run_until_complete(both())
    assert json.loads(version.body)["version"] == taco_notebook.__version__
    assert still_reading and released == [True], "the event loop was blocked by the registry read"
    assert (listing.code, json.loads(listing.body)) == (200, {"clusters": []})


def test_every_api_verb_runs_off_the_loop(api: Fetch, manager: ClusterManager, registry_dir: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Each verb's registry work runs in a thread other than the event loop's (kernel-owned requests included)."""
    loop_thread, threads = threading.get_ident(), set()
    for name in ("read_models", "read_model", "write_request"):
        real = getattr(registry, name)

        def noting(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
            threads.add(threading.get_ident())
            return _real(*args, **kwargs)

        monkeypatch.setattr(registry, name, noting)
    me = psutil.Process()
    make_entry(registry_dir, "k1", me.pid, me.create_time())
    assert api("GET", "clusters")[0] == 200
    assert api("GET", "clusters", "k1")[0] == 200
    assert api("PATCH", "clusters", "k1", body={"size": 2})[0] == 202
    assert api("DELETE", "clusters", "k1")[0] == 409  # a scale is pending: a 4xx that says so, not a 500
    assert threads and loop_thread not in threads


@pytest.mark.parametrize("authorizer_class", [ReadOnlyClusters])
def test_an_authorizer_that_denies_writes_gets_403_on_actions_only(jp_serverapp: Any, api: Fetch,
                                                                   manager: ClusterManager,
                                                                   registry_dir: Path) -> None:
    """Reads answer 200; start, stop and scale answer 403 naming the action and resource, and do nothing."""
    me = psutil.Process()
    make_entry(registry_dir, "k1", me.pid, me.create_time())
    assert api("GET", "version")[0] == 200
    code, listing = api("GET", "clusters")
    assert code == 200 and [m["id"] for m in listing["clusters"]] == ["k1"]
    assert api("GET", "clusters", "k1")[0] == 200
    refused = f"User is not authorized to write on resource: {AUTH_RESOURCE}."
    for method, parts, body in (("POST", ("clusters",), {"size": 1}), ("DELETE", ("clusters", "k1"), None),
                                ("PATCH", ("clusters", "k1"), {"size": 2})):
        code, reply = api(method, *parts, body=body)
        assert (code, reply["message"]) == (403, refused), (method, reply)
    assert manager._clusters == {} and not (registry_dir / "k1.request.json").exists()
    assert registry.read_model(registry_dir, "k1") is not None
    assert jp_serverapp.authorizer.asked == [("GET", "read")] * 3 + [
        ("POST", "write"), ("DELETE", "write"), ("PATCH", "write")]
