"""A one-host job opens nothing on the network: listening sockets of real 4-rank allreduces, started as users do.

A ``TacoCluster`` (what ``%%taco_run`` starts) launches its engines with MPICH's ``mpiexec.gforker``, which forks
the ranks and talks PMI over inherited sockets: no listener off loopback at all, no exception. The one listener
allowed off loopback is hydra's control port, where hydra is used (a plain ``mpiexec`` job a user starts, or
``TACO_MPI_LAUNCHER=hydra``): hydra binds it to 0.0.0.0 and no hydra option or variable changes that (``-iface
lo``, ``-launcher fork``, ``-localhost``, ``HYDRA_IFACE`` were tried; see taco_notebook/comm/group/rendezvous.py). It
is identified exactly, by the port hydra's proxies are told to dial back (``hydra_pmi_proxy --control-port
HOST:PORT``), and must belong to the ``mpiexec`` process.
"""

from __future__ import annotations

import ipaddress
import json
import os
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from ..support.mpirun import SCRIPTS, kill_session
from ..support.waiting import wait_until


@dataclass(frozen=True)
class Listener:
    pid: int
    command: str
    ip: str
    port: int
    kind: str  # "tcp" or "udp"

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.ip.split("%")[0]).is_loopback


def job_processes(roots: list[psutil.Process]) -> list[psutil.Process]:
    found: dict[int, psutil.Process] = {}
    for root in roots:
        try:
            for proc in [root, *root.children(recursive=True)]:
                found[proc.pid] = proc
        except psutil.Error:
            continue
    return list(found.values())


def listeners(procs: list[psutil.Process]) -> list[Listener]:
    """Every TCP socket in LISTEN and every unconnected UDP socket the processes hold (inherited ones included)."""
    found = set()
    for proc in procs:
        try:
            command = " ".join(proc.cmdline())[:120]
            conns = proc.net_connections(kind="inet")
        except psutil.Error:
            continue
        for conn in conns:
            tcp = conn.type == __import__("socket").SOCK_STREAM
            if (tcp and conn.status == psutil.CONN_LISTEN) or (not tcp and not conn.raddr):
                found.add(Listener(proc.pid, command, conn.laddr.ip, conn.laddr.port, "tcp" if tcp else "udp"))
    return sorted(found, key=lambda item: (item.pid, item.port))


def hydra_control_port(procs: list[psutil.Process]) -> tuple[int, int] | None:
    """(mpiexec pid, port) of hydra's control port, read from its proxies' command lines."""
    for proc in procs:
        try:
            argv = proc.cmdline()
        except psutil.Error:
            continue
        if argv and os.path.basename(argv[0]) == "hydra_pmi_proxy" and "--control-port" in argv:
            port = int(argv[argv.index("--control-port") + 1].rsplit(":", 1)[1])
            return proc.ppid(), port
    return None


def off_loopback(procs: list[psutil.Process], allow_hydra: bool = True) -> tuple[list[Listener], list[Listener]]:
    """(listeners on loopback, listeners elsewhere other than hydra's control port held by mpiexec, if allowed)."""
    found = listeners(procs)
    hydra = hydra_control_port(procs) if allow_hydra else None
    allowed: set[int] = set()
    if hydra is not None:
        mpiexec_pid, port = hydra
        held = {(item.port, item.ip) for item in found if item.pid == mpiexec_pid}
        if (port, "0.0.0.0") in held:  # the documented exception, exactly that socket
            allowed.add(port)
    outside = [item for item in found if not item.loopback and item.port not in allowed]
    return [item for item in found if item.loopback], outside


def _wait_for_reports(job: subprocess.Popen[str], reports: Path, n: int, timeout: float) -> list[dict]:
    deadline = time.monotonic() + timeout
    while len(list(reports.glob("rank*.json"))) < n:
        if job.poll() is not None:
            raise AssertionError(f"the job ended (code {job.returncode}) before every rank was ready:\n"
                                 + (job.stdout.read() if job.stdout else ""))
        assert time.monotonic() < deadline, "the ranks were not ready in time"
        time.sleep(0.2)
    return [json.loads(path.read_text()) for path in sorted(reports.glob("rank*.json"))]


@pytest.mark.parametrize("store", ["file", "tcp"])
def test_plain_mpiexec_job_listens_only_on_loopback_and_removes_its_store(mpiexec, tmp_path, store):
    """``file``: the one-host default. ``tcp``: TACO_MASTER_ADDR forces the several-hosts path, whose TCPStore
    must listen on that address only (torch's own would listen on every interface)."""
    stop, report_dir = tmp_path / "stop", tmp_path / "reports"
    report_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("UCX_TLS", "GLOO_SOCKET_IFNAME", "TACO_MASTER_ADDR")}
    env["OMP_NUM_THREADS"] = "1"
    if store == "tcp":
        env["TACO_MASTER_ADDR"] = "127.0.0.1"
    job = subprocess.Popen([mpiexec, "-n", "4", sys.executable, str(SCRIPTS / "listening_allreduce.py"), str(stop),
                            str(report_dir)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                           start_new_session=True)
    try:
        reports = _wait_for_reports(job, report_dir, 4, timeout=240)
        # everyone meets at one place; UCX on shared memory; on one host, gloo pinned to loopback and the
        # FileStore made private by rank 0 from the start
        assert {r["kind"] for r in reports} == {store}, reports
        assert len({r["address"] for r in reports}) == 1, reports
        assert {r["ucx_tls"] for r in reports} == {"self,sm"}, reports
        if store == "file":
            assert {r["ifname"] for r in reports} == {"lo"}, reports
            path = Path(reports[0]["address"])
            assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
        else:
            assert reports[0]["address"].startswith("127.0.0.1:"), reports
        inside, outside = [], []
        for _ in range(3):  # sampled while the ranks allreduce
            procs = job_processes([psutil.Process(job.pid)])
            found_inside, found_outside = off_loopback(procs)
            inside += found_inside
            outside += found_outside
            time.sleep(0.5)
        assert hydra_control_port(procs) is not None, "hydra's proxy not found: the listing saw no job"
        assert not outside, f"listening off loopback: {outside}"
        rank_pids = {p.pid for p in procs if "listening_allreduce.py" in " ".join(p.cmdline())}
        assert len({item.pid for item in inside} & rank_pids) == 4, inside  # each rank's gloo pair, on loopback
        if store == "tcp":
            port = int(reports[0]["address"].rsplit(":", 1)[1])
            assert {item.ip for item in inside if item.port == port} == {"127.0.0.1"}, inside
        stop.touch()
        output, _ = job.communicate(timeout=120)
        assert job.returncode == 0, output
    finally:
        if job.returncode is None:  # not seen to end: kill it and every process it started
            kill_session(job)
            job.communicate()
    if store == "file":
        assert not Path(reports[0]["address"]).parent.exists(), "the rendezvous directory outlived the group"


def _allreduce_for(seconds: float) -> int:
    import time as _time

    import torch as _torch

    import taco_notebook.comm as _taco

    t, steps, end = _torch.ones(1 << 16), 0, _time.monotonic() + seconds
    while True:
        _taco.allreduce(t, op="avg")
        flag = _torch.tensor([float(_time.monotonic() > end)])
        _taco.allreduce(flag, op="max")
        steps += 1
        if flag.item():
            return steps


def _rendezvous_report() -> dict[str, object]:
    import os as _os

    from taco_notebook.comm.group.bootstrap import state as _state

    meeting = _state.rendezvous
    return {"kind": meeting.kind, "address": meeting.address, "ifname": _os.environ.get("GLOO_SOCKET_IFNAME"),
            "ucx_tls": _os.environ.get("UCX_TLS")}


def _reinit() -> None:
    import taco_notebook.comm as _taco

    _taco.reinit()


def _listening_during_allreduce(cluster, allow_hydra: bool) -> tuple[list[psutil.Process], list[Listener]]:
    """The cluster's processes and its listeners on loopback, sampled while every rank allreduces; asserts that
    none listens elsewhere (hydra's control port excepted only when ``allow_hydra``)."""
    running = cluster.view.apply_async(_allreduce_for, 4.0)
    time.sleep(1.0)
    procs = job_processes(list(cluster.processes))
    inside, outside = off_loopback(procs, allow_hydra=allow_hydra)
    steps = running.get(timeout=120)
    assert all(s > 0 for s in steps), steps
    assert not outside, f"listening off loopback: {outside}"
    assert any("taco_notebook.controller" in item.command for item in inside), inside  # on 127.0.0.1
    engines = {item.pid for item in inside if "ipyparallel.engine --mpi" in item.command}
    assert len(engines) == cluster.size, inside  # each rank's gloo pair, on loopback
    return procs, inside


def _launchers(procs: list[psutil.Process]) -> set[str]:
    names = set()
    for proc in procs:
        try:
            names.add(os.path.basename(proc.exe()))
        except psutil.Error:
            continue
    return names & {"mpiexec", "mpiexec.hydra", "mpiexec.gforker", "hydra_pmi_proxy"}


def test_taco_cluster_listens_on_nothing_off_loopback_and_reinit_replaces_the_store(shared_cluster):
    """gforker, the one-host launcher: not even a launcher port off loopback."""
    assert shared_cluster.mpi is not None and shared_cluster.mpi.launcher == "gforker", shared_cluster.mpi
    view = shared_cluster.view
    view.apply_sync(_reinit)  # a group every rank holds: an earlier test's failed cell may have aborted rank 0's
    before = view.apply_sync(_rendezvous_report)
    assert {r["kind"] for r in before} == {"file"} and len({r["address"] for r in before}) == 1, before
    assert {(r["ifname"], r["ucx_tls"]) for r in before} == {("lo", "self,sm")}, before
    store = Path(before[0]["address"])
    assert stat.S_IMODE(store.parent.stat().st_mode) == 0o700

    procs, _ = _listening_during_allreduce(shared_cluster, allow_hydra=False)
    assert _launchers(procs) == {"mpiexec.gforker"}, _launchers(procs)  # the listing saw the job, and no hydra

    view.apply_sync(_reinit)  # the group is rebuilt: a new private store, the old one removed
    after = view.apply_sync(_rendezvous_report)
    assert len({r["address"] for r in after}) == 1 and after[0]["address"] != before[0]["address"], after
    # at once when every peer let go within shutdown's wait, else a moment after (Rendezvous.close)
    wait_until(lambda: not store.parent.exists(), 10, "the old store's directory removed")


@pytest.mark.mpi
def test_hydra_chosen_by_env_listens_only_on_its_control_port_off_loopback(monkeypatch):
    """``TACO_MPI_LAUNCHER=hydra`` keeps hydra, and with it the one documented listener on 0.0.0.0."""
    from taco_notebook.cluster.session import TacoCluster

    monkeypatch.setenv("TACO_MPI_LAUNCHER", "hydra")
    cluster = TacoCluster("hydra-listen", size=2)
    try:
        cluster.start()
        assert cluster.mpi is not None and cluster.mpi.launcher == "hydra", cluster.mpi
        assert os.path.basename(cluster.mpi.mpiexec) == "mpiexec", cluster.mpi
        procs, _ = _listening_during_allreduce(cluster, allow_hydra=True)
        assert hydra_control_port(procs) is not None, "hydra's proxy not found: the listing saw no job"
        assert off_loopback(procs, allow_hydra=False)[1], "hydra's control port on 0.0.0.0 was expected"
    finally:
        cluster.stop()


def test_sweep_removes_only_our_directories_whose_rank_0_is_gone(tmp_path):
    from taco_notebook.comm.group import rendezvous

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid, ns = int(gone.stdout), rendezvous._pid_namespace()
    stale = tmp_path / f"taco-rendezvous-{ns}-{dead_pid}-abc"
    live = tmp_path / f"taco-rendezvous-{ns}-{os.getpid()}-abc"
    other_ns = tmp_path / f"taco-rendezvous-1-{dead_pid}-abc"
    unrelated = tmp_path / "taco-rendezvous-x"
    for path in (stale, live, other_ns, unrelated):
        path.mkdir(mode=0o700)
        (path / "store").write_text("")
    link = tmp_path / f"taco-rendezvous-{ns}-{dead_pid}-link"
    link.symlink_to(live)
    kept = [live, other_ns, unrelated, link]
    if os.geteuid() == 0:  # another user's directory is never touched, even when its creator is gone
        foreign = tmp_path / f"taco-rendezvous-{ns}-{dead_pid}-foreign"
        foreign.mkdir()
        os.chown(foreign, 65534, 65534)
        kept.append(foreign)
    assert rendezvous.sweep_stale(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and all(p.exists() or p.is_symlink() for p in kept)


def _file_rendezvous(world: int) -> list[Any]:
    """A one-host rendezvous as ``create`` makes it, for ``world`` ranks of this process: real FileStores on one
    file in a fresh private directory, the first (rank 0's) owning the directory."""
    from datetime import timedelta

    import torch.distributed as dist

    from taco_notebook.comm.group import rendezvous

    directory, path = rendezvous._new_store_file()
    made = []
    for rank in range(world):
        store = dist.FileStore(path, world)
        store.set_timeout(timedelta(seconds=30))
        made.append(rendezvous.Rendezvous(store, "file", path, directory if rank == 0 else None))
    return made


def test_an_aborting_creator_unlinks_the_store_at_once_and_removes_its_directory_after_the_peers(monkeypatch):
    """abort() closes with no wait. Removing the directory at once let a peer's FileStore destructor, between its
    check of the file and its open, retry ENOENT for the whole store timeout with the GIL held (the peer's
    ``engine.abort`` hung at the 7th and the 32nd of a loop of aborts on 4 ranks). Now the file goes at once, so a
    peer closing after finds nothing to count itself out of, and a peer that already saw the file recreates it in
    a directory that is still there; the directory goes REAP_AFTER_S later."""
    from taco_notebook.comm.group import rendezvous

    monkeypatch.setattr(rendezvous, "REAP_AFTER_S", 0.5)
    creator, late, in_window = _file_rendezvous(3)
    directory, path = Path(creator.directory), Path(creator.address)
    creator.close(0.0)
    reaper = rendezvous._reaping.get(str(directory))
    assert not path.exists() and directory.is_dir() and reaper is not None and reaper.is_alive()
    started = time.monotonic()
    late.close(0.0)  # its destructor finds no file: it returns at once
    assert time.monotonic() - started < 1.0 and not path.exists()
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))  # what a destructor already past its check does
    in_window.close(0.0)
    wait_until(lambda: not directory.exists(), 10, "the reaper removing the rendezvous directory")
    reaper.join(10)
    assert not reaper.is_alive() and str(directory) not in rendezvous._reaping


def test_a_shutdown_after_the_peers_let_go_removes_the_directory_at_once():
    """shutdown(): the peers' destructors count themselves out and the last removes the file; the creator waits
    for that and removes the directory itself, no timer."""
    from taco_notebook.comm.group import rendezvous

    creator, peer = _file_rendezvous(2)
    directory = Path(creator.directory)
    peer.close(2.0)
    creator.close(2.0)  # its own destructor is the last: it removes the file
    assert not directory.exists() and str(directory) not in rendezvous._reaping


def test_a_pending_removal_is_done_at_exit(tmp_path):
    """A creator that exits before its timer fires still removes the directory (atexit), not the next job."""
    code = ("from taco_notebook.comm.group import rendezvous\n"
            "from tests.comm.test_rendezvous import _file_rendezvous\n"
            "made = _file_rendezvous(2)\n"
            "print(made[0].directory, flush=True)\n"
            "made[0].close(0.0)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr
    directory = Path(done.stdout.strip())
    assert directory.name.startswith("taco-rendezvous-") and not directory.exists(), done.stdout


@pytest.mark.parametrize("local, world, preset, expect", [
    ("4", "4", None, "self,sm"),      # hydra: every rank on this host
    ("2", "4", None, None),           # two hosts (the emulated nodes): UCX must reach the other one
    ("4", "4", "tcp", "tcp"),         # the user's choice stands
    (None, None, None, None),         # not under hydra
])
def test_keep_mpi_local_only_when_hydra_says_every_rank_is_here(monkeypatch, local, world, preset, expect):
    from taco_notebook.comm.group import rendezvous

    for name, value in (("MPI_LOCALNRANKS", local), ("PMI_SIZE", world), ("UCX_TLS", preset)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)  # MPI not started yet in this process
    assert rendezvous.keep_mpi_local() is (expect is not None and preset is None)
    assert os.environ.get("UCX_TLS") == expect
