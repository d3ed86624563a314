"""ClusterManager without HTTP: body validation, 404/409 decisions, stale entries, and no tornado import."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from taco_notebook.cluster.registry import files as registry
from taco_notebook.server.manager import BadRequest, ClusterManager, Conflict, NotFound
from taco_notebook.server.requests import parse_scale_request, parse_start_request

from ..cluster.registry import test_registry
from ..cluster.registry.test_registry import dead_pid, make_entry

sleeper = test_registry.sleeper  # a fixture: processes that stand in for a dead kernel's leftovers


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[ClusterManager]:
    made = ClusterManager(tmp_path / "registry")
    yield made
    made.shutdown()


def me() -> tuple[int, float]:
    process = psutil.Process()
    return process.pid, process.create_time()


def test_server_package_and_manager_import_no_tornado() -> None:
    """The package is imported on every MPI rank, the manager by tests and kernels: neither may pull in tornado."""
    # the extension point names its app's factory (an ExtensionApp gets a shutdown call)
    code = ("import sys, taco_notebook, taco_notebook.server, taco_notebook.server.manager, "
            "taco_notebook.cluster.registry.writer, taco_notebook.cluster.session\n"
            "assert taco_notebook._jupyter_server_extension_points() == [{'module': 'taco_notebook.server', "
            "'app': taco_notebook.server.extension_app}]\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tornado', 'jupyter_server')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_a_cluster_and_the_wire_do_not_set_up_a_rank() -> None:
    """Importing TacoCluster or the wire's types (in the server, a kernel) imports neither torch nor the ranks'
    ``comm``, which installs its excepthook and pins GPUs at import, nor ipyparallel."""
    code = ("import sys, taco_notebook.cluster.session, taco_notebook.engine.wire\n"
            "print(sorted(m for m in ('torch', 'taco_notebook.comm', 'ipyparallel') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(("body", "words"), [
    (b"{not json", "JSON object"),
    (b"[1]", "JSON object"),
    (b"{}", "'size' is required"),
    (b'{"size": "x"}', "'size' must be a positive integer, got \"x\""),
    (b'{"size": 0}', "'size' must be a positive integer, got 0"),
    (b'{"size": true}', "'size' must be a positive integer"),
    (b'{"size": 2.5}', "'size' must be a positive integer"),
    (b'{"size": 2, "ranks": 3}', "unknown field(s) 'ranks'"),
    (b'{"size": 2, "name": "a b"}', "field 'name' must be"),
])
def test_start_body_errors_name_the_field(body: bytes, words: str) -> None:
    with pytest.raises(BadRequest) as info:
        parse_start_request(body)
    assert words in str(info.value)


def test_valid_bodies() -> None:
    assert parse_start_request(b'{"size": 3, "name": "big-1"}') == {"size": 3, "name": "big-1"}
    assert parse_scale_request('{"size": 1}') == {"size": 1}
    with pytest.raises(BadRequest, match="unknown field"):
        parse_scale_request({"size": 1, "name": "x"})


def test_empty_and_unknown(manager: ClusterManager) -> None:
    assert manager.list() == {"clusters": []}
    for bad in ("nope", "../etc", ".hidden"):
        with pytest.raises(NotFound, match=f"No such cluster: {bad}"):
            manager.get(bad)
        with pytest.raises(NotFound):
            manager.stop(bad)


def test_kernel_cluster_requests_and_conflicts(manager: ClusterManager) -> None:
    make_entry(manager.directory, "k1", *me())
    [listed] = manager.list()["clusters"]
    assert listed["id"] == "k1" and listed["pending"] is None
    with pytest.raises(Conflict, match="already runs 1 ranks"):
        manager.scale("k1", b'{"size": 1}')
    answer = manager.scale("k1", b'{"size": 4}')
    assert answer["pending"] is not None and (answer["pending"]["action"], answer["pending"]["size"]) == ("scale", 4)
    request = json.loads((manager.directory / "k1.request.json").read_text())
    assert (request["action"], request["size"]) == ("scale", 4)
    assert manager.get("k1")["pending"] == answer["pending"]
    with pytest.raises(Conflict, match="already has a pending scale"):
        manager.stop("k1")

    make_entry(manager.directory, "k2", *me(), state="stopping")
    with pytest.raises(Conflict, match="is stopping"):
        manager.stop("k2")
    make_entry(manager.directory, "s1", *me(), kind="server")
    with pytest.raises(Conflict, match="another Jupyter server"):
        manager.stop("s1")


def test_stale_entry_is_deleted_not_scaled(manager: ClusterManager, sleeper: Callable[..., psutil.Process]) -> None:
    """A dead owner's entry with a process of its cluster left: stale, not scalable, deleted with that process."""
    left = sleeper("gone")
    make_entry(manager.directory, "gone", *dead_pid(), processes=[(left.pid, left.create_time())])
    model = manager.get("gone")
    assert model["state"] == "stale" and "1 process it started is still running" in (model["error"] or "")
    with pytest.raises(Conflict, match="stale"):
        manager.scale("gone", {"size": 2})
    assert manager.stop("gone")["state"] == "stopped"
    left.wait(10)
    assert not (manager.directory / "gone.json").exists()
    with pytest.raises(NotFound):
        manager.get("gone")


def test_stale_entry_with_nothing_left_is_removed(manager: ClusterManager,
                                                  sleeper: Callable[..., psutil.Process]) -> None:
    """No STALE card when nothing is left running; a process merely named in it is not 'left'."""
    unrelated = sleeper()
    owner, created = dead_pid()
    make_entry(manager.directory, "gone", owner, created, processes=[(unrelated.pid, unrelated.create_time())])
    assert manager.list() == {"clusters": []}
    assert not (manager.directory / "gone.json").exists() and unrelated.is_running()


def test_async_twins_answer_as_the_methods_do_from_a_worker_thread(manager: ClusterManager,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Each ``*_async`` twin returns what its method returns and raises what it raises, having run in
    a thread other than the awaiting event loop's."""
    threads = set()
    read_models = registry.read_models

    def noting(*args: object, **kwargs: object) -> object:
        threads.add(threading.get_ident())
        return read_models(*args, **kwargs)

    monkeypatch.setattr(registry, "read_models", noting)
    make_entry(manager.directory, "k1", *me())

    async def twins() -> None:
        assert await manager.list_async() == manager.list()
        assert await manager.get_async("k1") == manager.get("k1")
        assert await manager.version_async() == manager.version()
        assert (await manager.scale_async("k1", {"size": 3}))["pending"] == manager.get("k1")["pending"]
        with pytest.raises(NotFound, match="No such cluster: nope"):
            await manager.stop_async("nope")
        with pytest.raises(BadRequest, match="'size' is required"):
            await manager.start_async({})
        await manager.shutdown_async()
        with pytest.raises(Conflict, match="shutting down"):
            await manager.start_async({"size": 1})

    asyncio.run(twins())
    assert threading.get_ident() in threads and len(threads) >= 2  # the sync calls here, the twins elsewhere
    assert [ClusterManager.list_async.__name__, ClusterManager.list_async.__qualname__] == [
        "list_async", "ClusterManager.list_async"]


def test_requests_at_once_to_a_kernel_cluster_leave_one_pending(manager: ClusterManager,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The handlers call in from several threads; of stop and scale requests that arrive together (a
    slow registry read widens the window), one is written and every other is a 409, as on one event loop."""
    make_entry(manager.directory, "k1", *me())
    read_model = registry.read_model

    def slow(*args: object, **kwargs: object) -> object:
        model = read_model(*args, **kwargs)
        time.sleep(0.05)  # what was read is what the check sees: the window between check and write
        return model

    monkeypatch.setattr(registry, "read_model", slow)

    async def together() -> list[object]:
        calls = [manager.stop_async("k1") if i % 2 else manager.scale_async("k1", {"size": 2}) for i in range(6)]
        return await asyncio.gather(*calls, return_exceptions=True)

    answers = asyncio.run(together())
    written = [a for a in answers if isinstance(a, dict)]
    assert len(written) == 1 and all(isinstance(a, Conflict) for a in answers if a not in written), answers
    assert manager.get("k1")["pending"] == written[0]["pending"]


def test_no_start_after_shutdown(manager: ClusterManager) -> None:
    manager.shutdown()
    with pytest.raises(Conflict, match="shutting down"):
        manager.start({"size": 1})
    assert manager.list() == {"clusters": []}


def test_registry_dir_default_and_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "rt"))
    assert registry.registry_dir() == tmp_path / "rt" / "taco-notebook" / "clusters"
    monkeypatch.setenv(registry.ENV_VAR, str(tmp_path / "elsewhere"))
    assert ClusterManager().directory == tmp_path / "elsewhere"
    assert os.fspath(registry.registry_dir(tmp_path)) == os.fspath(tmp_path)


def test_openapi_spec_matches_the_models() -> None:
    """The published spec and the TypedDicts must not drift apart (the TypeScript side reads the spec)."""
    import typing

    import yaml

    import taco_notebook.server
    from taco_notebook import model as models

    spec = yaml.safe_load((Path(taco_notebook.server.__file__).parent / "openapi.yaml").read_text())
    schemas = spec["components"]["schemas"]
    cluster = schemas["ClusterModel"]
    assert cluster["required"] == list(models.ClusterModel.__annotations__)
    props = cluster["properties"]
    nested = {"owner": models.Owner, "hugepages": models.HugePagesModel, "run": models.RunModel,
              "pending": models.PendingModel, "membership": models.MembershipModel}
    for field, typed in nested.items():
        assert props[field]["required"] == list(typed.__annotations__), field
    assert props["nodes"]["items"]["required"] == list(models.NodeModel.__annotations__)
    assert props["membership"]["properties"]["lost"]["items"]["required"] == list(models.LostRankModel.__annotations__)
    assert props["state"]["enum"] == list(typing.get_args(models.State))
    assert schemas["Error"]["required"] == list(models.ErrorModel.__annotations__)
    assert set(schemas["StartRequest"]["properties"]) == set(models.StartRequest.__annotations__)


def test_this_server_tells_its_own_kernels_from_other_servers(manager: ClusterManager) -> None:
    """``this_server``: True for an entry whose kernel's server is this process, False for another server's."""
    for cluster_id, server_pid in (("mine", os.getpid()), ("theirs", 1), ("unknown", None)):
        make_entry(manager.directory, cluster_id, *me())
        path = manager.directory / f"{cluster_id}.json"
        entry = json.loads(path.read_text())
        entry["model"]["owner"].update(notebook=f"{cluster_id}.ipynb", server_pid=server_pid)
        registry.write_atomic(path, entry)
    served = {m["id"]: (m["this_server"], m["owner"]["notebook"]) for m in manager.list()["clusters"]}
    assert served == {"mine": (True, "mine.ipynb"), "theirs": (False, "theirs.ipynb"),
                      "unknown": (False, "unknown.ipynb")}
