"""Safe on a shared host. Real clusters, a real Jupyter server, and, where the tests run as root, a real
second user (``nobody``, through ``setpriv``) playing the attacker.

What is proven here: what the project writes is private (modes, and ``nobody`` reading it), a forged registry entry
or request file cannot kill or resize anything, a registry directory another user could control is refused, and
the REST API answers hostile input with a 4xx, starts nothing and keeps answering.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from pytest_jupyter.jupyter_server import *  # noqa: F403  (fixtures: jp_fetch, jp_serverapp, ...)

from taco_notebook.cluster.launch.limits import max_ranks
from taco_notebook.cluster.registry import files as registry
from taco_notebook.cluster.registry import writer as registry_writer
from taco_notebook.cluster.session import TacoCluster, clusters
from taco_notebook.private import UnsafeDirectoryError, check_private_dir
from taco_notebook.server.manager import ClusterManager, UnsafeRegistry
from taco_notebook.server.requests import MAX_BODY_BYTES

from ..conftest import cluster_pids
from ..server import test_server
from ..server.test_server import API, Fetch
from .registry.test_registry import dead_pid, make_entry, wait_for

# the REST fixtures of test_server.py (a server with the extension, its manager, a registry of the test's own)
api, manager, registry_dir, jp_server_config = (test_server.api, test_server.manager, test_server.registry_dir,
                                                test_server.jp_server_config)

NOBODY = 65534
AS_ROOT = os.geteuid() == 0 and shutil.which("setpriv") is not None
needs_root = pytest.mark.skipif(not AS_ROOT, reason="playing a second user (setpriv --reuid=65534) needs root")


def as_nobody(*command: str, cwd: str = "/") -> subprocess.CompletedProcess[str]:
    """Run ``command`` as the unprivileged user ``nobody``: the other user of a shared host."""
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *command],
                          capture_output=True, text=True, timeout=60, cwd=cwd, check=False)


@pytest.fixture
def sleep_process() -> Iterator[psutil.Process]:
    """An unrelated process of this user (``sleep``): what a forged entry would like killed."""
    proc = subprocess.Popen(["sleep", "300"])
    yield psutil.Process(proc.pid)
    proc.kill()
    proc.wait(10)


# ------------------------------------------------------------------------------------------ private files
_FRESH_HOME_JOB = textwrap.dedent("""
    import json, os, subprocess, sys
    from taco_notebook.cluster.registry.writer import track
    from taco_notebook.cluster.session import TacoCluster, clusters
    home, as_root = sys.argv[1], sys.argv[2] == "1"
    cluster = track(TacoCluster("modes", 2))
    try:
        cluster.start()
        cluster.view.execute("import sys; print('engine output', file=sys.stderr)", block=True)
        found = []
        for top, dirs, files in os.walk(home):
            for name in dirs + files:
                path = os.path.join(top, name)
                info = os.lstat(path)
                readable = None
                if as_root:
                    probe = ["ls", path] if name in dirs else ["cat", path]
                    readable = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                                               *probe], capture_output=True, cwd="/").returncode == 0
                found.append({"path": path, "mode": info.st_mode, "dir": name in dirs, "nobody_reads": readable})
        print(json.dumps(found))
    finally:
        cluster.stop()
""")


@pytest.mark.cluster
def test_everything_written_on_a_fresh_home_is_private(tmp_path: Path) -> None:
    """The README's main job on a fresh home (0755, nothing in it): the Jupyter runtime dir, the registry, the
    ipyparallel profile and its logs are created private; as root, ``nobody`` can read none of it."""
    home = tmp_path / "home"
    home.mkdir()
    os.chmod(home, 0o755)
    env = {k: v for k, v in os.environ.items()
           if k not in ("TACO_REGISTRY_DIR", "JUPYTER_RUNTIME_DIR", "JUPYTER_DATA_DIR", "IPYTHONDIR",
                        "XDG_DATA_HOME", "XDG_RUNTIME_DIR", "JUPYTER_CONFIG_DIR")}
    env["HOME"] = str(home)
    if AS_ROOT:
        os.chmod(tmp_path, 0o755)  # let nobody reach HOME itself, as on a real host
    out = subprocess.run([sys.executable, "-c", _FRESH_HOME_JOB, str(home), "1" if AS_ROOT else "0"],
                         env=env, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    paths = {Path(f["path"]).relative_to(home).as_posix(): f for f in found}
    runtime = ".local/share/jupyter/runtime"
    for expected in (runtime, f"{runtime}/taco-notebook/clusters", ".ipython/taco-ipyparallel",
                     ".ipython/taco-ipyparallel/log"):
        assert expected in paths, f"{expected} was not created: {sorted(paths)}"
    assert any(p.startswith(f"{runtime}/taco-notebook/clusters/modes-") for p in paths)
    assert any(p.startswith(".ipython/taco-ipyparallel/log/") and not f["dir"] for p, f in paths.items()), \
        "no engine log was written"
    # what taco or ipyparallel makes for it (IPython itself adds profile_default inside the private .ipython)
    ours_dirs = [p for p, f in paths.items() if f["dir"] and (p.startswith(".local") or p == ".ipython"
                                                                or p.startswith(".ipython/taco-ipyparallel"))]
    loose_dirs = {p: oct(stat.S_IMODE(paths[p]["mode"])) for p in ours_dirs if paths[p]["mode"] & 0o077}
    assert not loose_dirs, f"directories others can open: {loose_dirs}"
    # ipyparallel opens its log files itself (0644 under the usual umask): the 0700 directories above keep them;
    # every file taco_notebook writes itself is 0600.
    ours = {p: oct(stat.S_IMODE(f["mode"])) for p, f in paths.items() if "taco-notebook" in p and not f["dir"]}
    assert ours and all(mode == "0o600" for mode in ours.values()), ours
    if AS_ROOT:
        leaked = [p for p, f in paths.items() if f["nobody_reads"]]
        assert not leaked, f"nobody could read: {leaked}"


# ------------------------------------------------------------------------------------------ forged registry files
def test_forged_stale_entry_cannot_get_a_process_killed(api: Fetch, registry_dir: Path,
                                                        sleep_process: psutil.Process) -> None:
    """An entry with a dead owner naming an unrelated process of this user (pid and true create time): the process
    is not the cluster's (no marker), so the entry is dropped as 'nothing left' and DELETE kills nothing."""
    owner, created = dead_pid()
    for cluster_id in ("forged-1", "forged-2"):
        make_entry(registry_dir, cluster_id, owner, created,
                   processes=[(sleep_process.pid, sleep_process.create_time())],
                   rank_pids=[(0, sleep_process.pid)])
    if AS_ROOT:  # the other user cannot even plant it: the registry is 0700
        attempt = as_nobody(sys.executable, "-c", f"open({str(registry_dir / 'x.json')!r}, 'w')")
        assert attempt.returncode != 0 and "Permission denied" in attempt.stderr
    code, reply = api("DELETE", "clusters", "forged-1")
    assert code == 404 and reply["message"] == "No such cluster: forged-1"
    assert api("GET", "clusters") == (200, {"clusters": []})
    assert registry.discard_stale(registry_dir, "forged-2") == []  # the same entry, straight to the registry
    time.sleep(0.5)
    assert sleep_process.is_running() and sleep_process.status() != psutil.STATUS_ZOMBIE
    assert list(registry_dir.iterdir()) == []


def _plant(directory: Path, name: str, content: dict[str, Any], owner: int | None = None) -> Path:
    path = directory / name
    path.write_text(json.dumps(content))
    if owner is not None:
        os.chown(path, owner, owner)
    return path


@pytest.mark.cluster
def test_forged_requests_cannot_resize_a_cluster(registry_dir: Path) -> None:
    """A kernel's cluster keeps its size and its engines through an over-limit request, a request of another
    user's and a symlinked one; as root, nobody cannot write a request into the registry at all."""
    cluster = registry_writer.track(TacoCluster("forgery", 1))
    try:
        cluster.start()
        cluster_id = cluster.cluster_id or ""
        engines = sorted(r.pid for r in cluster.ranks)
        request = registry_dir / f"{cluster_id}.request.json"
        forged = [{"action": "scale", "size": 10**30, "requested_at": time.time()},
                  {"action": "scale", "size": max_ranks() + 1, "requested_at": time.time()}]
        for body in forged:
            _plant(registry_dir, request.name, body)
            wait_for(lambda: not os.path.lexists(request), 30, "the watcher to take the request")
        if AS_ROOT:
            _plant(registry_dir, request.name, {"action": "scale", "size": 2, "requested_at": 1.0}, owner=NOBODY)
            wait_for(lambda: not os.path.lexists(request), 30, "the watcher to drop nobody's request")
            attempt = as_nobody(sys.executable, "-c", f"open({str(request)!r}, 'w').write('{{}}')")
            assert attempt.returncode != 0 and "Permission denied" in attempt.stderr
        target = registry_dir.parent / "elsewhere.json"
        target.write_text(json.dumps({"action": "stop", "size": None, "requested_at": 1.0}))
        request.symlink_to(target)
        wait_for(lambda: not os.path.lexists(request), 30, "the watcher to drop the symlink")
        time.sleep(3 * registry_writer.POLL_INTERVAL)
        model = registry.read_model(registry_dir, cluster_id)
        assert model is not None and (model["state"], model["size"], model["pending"]) == ("running", 1, None)
        assert cluster.size == 1 and sorted(r.pid for r in cluster.ranks) == engines
        assert all(psutil.pid_exists(pid) for pid in engines) and target.exists()
    finally:
        cluster.stop()


# ------------------------------------------------------------------------------------------ the registry directory
def _unsafe_dirs(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    open_dir = tmp_path / "world-writable"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    yield open_dir, "chmod 700"
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(private)
    yield link, "not a directory but a symlink"
    if AS_ROOT:
        foreign = tmp_path / "foreign"
        foreign.mkdir(mode=0o700)
        os.chown(foreign, NOBODY, NOBODY)
        yield foreign, "belongs to another user"


def test_a_registry_dir_others_control_is_refused(tmp_path: Path, sleep_process: psutil.Process) -> None:
    """World-writable, a symlink, or (as root) owned by nobody: the server reads nothing there and kills nothing,
    the kernel writes nothing there, and the message says how to fix it."""
    owner, created = dead_pid()
    for directory, words in _unsafe_dirs(tmp_path):
        real = directory.resolve()
        make_entry_as_planted(real, sleep_process, owner, created)
        with pytest.raises(UnsafeDirectoryError, match=words):
            check_private_dir(directory)
        refusing = ClusterManager(directory)
        try:
            for call, args in ((refusing.list, ()), (refusing.stop, ("planted",)), (refusing.get, ("planted",))):
                with pytest.raises(UnsafeRegistry) as info:
                    call(*args)  # type: ignore[operator]
                assert words in str(info.value) and str(directory) in str(info.value)
                assert "TACO_REGISTRY_DIR" in str(info.value)
        finally:
            refusing.shutdown()
        cluster = registry_writer.track(TacoCluster("unwritten", 1), directory)
        cluster.owner_kind, cluster.cluster_id = "server", "unwritten-1"
        cluster.announce_start()  # the writer answers the event, refusing the directory
        assert cluster not in registry_writer.tracked()  # (a logged warning; nothing written, nothing raised)
        cluster.stop()
        assert not (real / "unwritten-1.json").exists()
        assert sleep_process.is_running()


def make_entry_as_planted(directory: Path, victim: psutil.Process, owner: int, created: float) -> None:
    """An entry for a stale cluster naming ``victim``, planted as the directory's owner would (a plain write)."""
    entry = {"model": {"id": "planted", "name": "planted", "profile": "taco", "owner": {"kind": "kernel",
                                                                                       "pid": owner},
                       "state": "running", "size": 1, "engines_up": 1, "mpi": "", "nodes": [], "gpus": 0,
                       "hugepages": None, "started_at": 1.0, "updated_at": 1.0, "run": None, "pending": None,
                       "error": None},
             "owner_create_time": created, "processes": [(victim.pid, victim.create_time())], "rank_pids": []}
    path = directory / "planted.json"
    path.write_text(json.dumps(entry))
    stat_dir = os.lstat(directory)
    if stat_dir.st_uid != os.geteuid():
        os.chown(path, stat_dir.st_uid, stat_dir.st_gid)


def test_rest_refuses_an_unsafe_registry_dir(api: Fetch, registry_dir: Path) -> None:
    registry_dir.mkdir(mode=0o700)
    os.chmod(registry_dir, 0o777)
    code, reply = api("GET", "clusters")
    assert code == 500 and "group or others may write it" in reply["message"] and "chmod 700" in reply["message"]
    os.chmod(registry_dir, 0o700)
    assert api("GET", "clusters") == (200, {"clusters": []})


# ------------------------------------------------------------------------------------------ hostile REST input
def _nothing_started(api: Fetch, manager: ClusterManager) -> None:
    assert api("GET", "clusters") == (200, {"clusters": []})
    assert manager._clusters == {}
    # the session's own clusters (the shared one a previous test may have started) are not this request's
    earlier = {pid for name in list(clusters) for pid in cluster_pids(name)}
    assert not [p for p in psutil.Process().children(recursive=True)
                if p.name() in ("mpiexec", "hydra_pmi_proxy") and p.pid not in earlier]


@pytest.mark.parametrize(("method", "parts", "body", "status", "words"), [
    ("POST", ("clusters",), {"size": 10**30}, 400, "TACO_MAX_RANKS"),
    ("POST", ("clusters",), {"size": "9" * 5000}, 400, "'size' must be a positive integer"),
    ("POST", ("clusters",), {"size": 1, "name": "n" * 10000}, 400, "field 'name' must be"),
    ("POST", ("clusters",), {"size": 1, "x" * 10000: 1}, 400, "unknown field(s)"),
    ("POST", ("clusters",), "[" * 30000 + "]" * 30000, 400, "nested too deeply"),
    ("POST", ("clusters",), "[" * 100_000 + "]" * 100_000, 413, f"limit of {MAX_BODY_BYTES} bytes"),
    ("POST", ("clusters",), b'{"size": 1, "pad": "' + b"x" * (MAX_BODY_BYTES + 10) + b'"}', 413, "over the limit"),
    ("PATCH", ("clusters", "k1"), {"size": 10**30}, 400, "TACO_MAX_RANKS"),
])
def test_hostile_bodies_are_4xx_short_and_start_nothing(api: Fetch, manager: ClusterManager, registry_dir: Path,
                                                       method: str, parts: tuple[str, ...], body: Any, status: int,
                                                       words: str) -> None:
    me = psutil.Process()
    make_entry(registry_dir, "k1", me.pid, me.create_time())
    code, reply = api(method, *parts, body=body)
    assert code == status and words in reply["message"], reply
    assert len(reply["message"]) < 400 and len(reply["reason"]) <= 200
    assert not os.path.exists(registry_dir / "k1.request.json")
    (registry_dir / "k1.json").unlink()
    _nothing_started(api, manager)
    assert api("GET", "version")[0] == 200


def test_request_file_names_are_not_cluster_ids(api: Fetch, manager: ClusterManager, registry_dir: Path) -> None:
    """``clusters/{id}.request`` names the request file of cluster {id}, never a cluster: 404 for every verb."""
    me = psutil.Process()
    make_entry(registry_dir, "k1", me.pid, me.create_time())
    registry.write_request(registry_dir, "k1", "stop", None)
    for method, body in (("GET", None), ("PATCH", {"size": 2}), ("DELETE", None)):
        code, reply = api(method, "clusters", "k1.request", body=body)
        assert (code, reply["message"]) == (404, "No such cluster: k1.request"), (method, reply)
    code, reply = api("GET", "clusters", "x" * 5000)
    assert code == 404 and len(reply["message"]) < 120
    assert [m["id"] for m in api("GET", "clusters")[1]["clusters"]] == ["k1"]


def test_a_120_mb_body_is_refused_before_it_is_read(jp_asyncio_loop: Any, jp_http_port: int, jp_base_url: str,
                                                   jp_auth_header: dict[str, str], api: Fetch,
                                                   manager: ClusterManager) -> None:
    """Content-Length 120 MB: the 413 comes back after 1 MB was sent (the rest is never read) and the server
    closes that connection; then a real 120 MB body over tornado's client is refused too."""
    size = 120 * 1024 * 1024
    path = f"{jp_base_url.rstrip('/')}/{API}/clusters"
    headers = "".join(f"{k}: {v}\r\n" for k, v in jp_auth_header.items())

    async def raw() -> tuple[bytes, int]:
        reader, writer = await asyncio.open_connection("127.0.0.1", jp_http_port)
        writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{headers}Content-Type: application/json\r\n"
                     f"Content-Length: {size}\r\n\r\n".encode())
        sent = 0
        writer.write(b"x" * (1 << 20))
        sent += 1 << 20
        await writer.drain()
        head = await asyncio.wait_for(reader.read(4096), 30)
        writer.close()
        return head, sent

    head, sent = jp_asyncio_loop.run_until_complete(raw())
    assert head.startswith(b"HTTP/1.1 413"), head[:200]
    assert f"over the limit of {MAX_BODY_BYTES} bytes".encode() in head and sent < size
    code, _ = api("POST", "clusters", body=b"x" * size)
    assert code == 413
    _nothing_started(api, manager)


# ------------------------------------------------------------------------------ which notebook, which server
@pytest.mark.cluster
def test_a_kernels_cluster_names_its_notebook_and_server(api: Fetch, jp_serverapp: Any) -> None:
    """A real kernel started from this process (where the test's Jupyter server runs), with the environment
    jupyter_server's SessionManager.get_kernel_env gives a notebook's kernel (JPY_SESSION_NAME; jupyter_client's
    launcher adds JPY_PARENT_PID itself), starts a cluster: the model names the notebook and this server, and says
    it is this server's. (A kernel started through POST /api/sessions of pytest-jupyter's server died before
    answering here, so the session's environment is given as that server would give it.)"""
    from jupyter_client.manager import start_new_kernel

    notebook = str(Path(jp_serverapp.root_dir) / "train.ipynb")
    manager, client = start_new_kernel(kernel_name="python3", env={**os.environ, "JPY_SESSION_NAME": notebook})
    try:
        reply = client.execute_interactive("%load_ext taco_notebook\n%taco_cluster start -n 1 --cluster owned",
                                           timeout=480, output_hook=lambda msg: None)
        assert reply["content"]["status"] == "ok"
        [model] = api("GET", "clusters")[1]["clusters"]
        assert psutil.Process(manager.provisioner.process.pid).environ()["JPY_PARENT_PID"] == str(os.getpid())
        assert (model["owner"]["kind"], model["owner"]["notebook"]) == ("kernel", notebook)
        assert (model["owner"]["server_pid"], model["this_server"]) == (os.getpid(), True)
        reply = client.execute_interactive("%taco_cluster stop --cluster owned", timeout=120,
                                           output_hook=lambda msg: None)
        assert reply["content"]["status"] == "ok"
        wait_for(lambda: api("GET", "clusters")[1] == {"clusters": []}, 30, "the entry to go")
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=False)


# ------------------------------------------------------------------------------ shared-memory segments
def test_a_rank_maps_no_segment_it_does_not_own_or_that_is_a_symlink(tmp_path: Path) -> None:
    """What rank 0 names (a hugetlbfs or /dev/shm path) is opened with O_NOFOLLOW and refused if another user owns
    it: a file planted under the expected name in a shared mount is never mapped."""
    from taco_notebook.comm.transport.shmfile import open_own as _open_own

    own = tmp_path / "own"
    own.write_bytes(b"\0" * 16)
    os.close(_open_own(str(own)))
    link = tmp_path / "link"
    link.symlink_to(own)
    with pytest.raises(OSError):
        _open_own(str(link))
    if AS_ROOT:
        planted = tmp_path / "planted"
        planted.write_bytes(b"\0" * 16)
        os.chown(planted, NOBODY, NOBODY)
        with pytest.raises(PermissionError, match="belongs to uid 65534"):
            _open_own(str(planted))
