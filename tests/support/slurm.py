"""A real one-machine Slurm for the tests: munged, slurmctld and one slurmd, private to the test session.

Debian's ``slurm-wlm`` and ``munge`` (installed with apt as root when missing; no system service is enabled or
started: Debian's ``policy-rc.d`` keeps them off, and nothing here touches /etc/slurm or /etc/munge). Everything
lives in a private directory (0700): a generated munge key, munged's socket, pid and log, ``slurm.conf`` for this
host (NodeName = this hostname, CPUs and RealMemory as ``slurmd -C`` reports them, no cgroups, no accounting,
ports chosen free on 127.0.0.1), the state and spool directories. The daemons run in the foreground (``-D``/``-F``)
as children of this process, recorded by PID and stopped by PID; they are started without ``TACO_TEST_SESSION`` so
the per-test leak check (tests/conftest.py) sees only what a *job* started, not the long-lived daemons.

Client commands find this Slurm through ``SLURM_CONF`` (the fixture sets it in ``os.environ`` for its tests).
tests/cluster/conftest.py offers the ``slurm`` fixture to that folder's tests; :meth:`SlurmCluster.active_jobs`,
:meth:`SlurmCluster.active_jobs_after` and :func:`job_processes_after` are what they check a stopped job against.

    python -m tests.support.slurm      # start it, print the time to the first idle ``sinfo``, stop it
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import psutil
import pytest

__all__ = ["SlurmCluster", "start_slurm", "slurm", "slurm_unavailable", "PARTITION", "job_processes",
           "job_processes_after"]

PARTITION = "taco"
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scancel", "sinfo", "srun", "scontrol")
SESSION_ENV = "TACO_TEST_SESSION"
T = TypeVar("T")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _which(name: str) -> str | None:
    return shutil.which(name) or next((p for d in ("/usr/sbin", "/sbin")
                                       if os.access(p := os.path.join(d, name), os.X_OK)), None)


def _install() -> str | None:
    """apt-get the packages (root only); None when done, else why not."""
    if os.geteuid() != 0:
        return "a private Slurm needs root (slurmd runs jobs as their user, munged's key is root's)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        subprocess.run(["apt-get", "install", "-y", "-q", "slurm-wlm", "munge"], env=env, check=True,
                       capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as exc:
        out = getattr(exc, "stderr", "") or ""
        return f"`apt-get install slurm-wlm munge` failed: {exc} {out.strip()[-300:]}"
    return None


def slurm_unavailable() -> str | None:
    """Why a private Slurm cannot run here (None when it can), installing the packages if root and missing."""
    if os.geteuid() != 0:
        return "a private Slurm needs root (slurmd runs jobs as their user, munged's key is root's)"
    if all(_which(n) for n in DAEMONS + CLIENTS + ("mungekey",)):
        return None
    why = _install()
    if why is None and not all(_which(n) for n in DAEMONS + CLIENTS):
        why = "slurm-wlm/munge installed but their programs are missing"
    return why


def _node_line(hostname: str) -> str:
    """``slurmd -C``'s own view of this host, so the node registers without a mismatch (and drain)."""
    out = subprocess.run([_which("slurmd") or "slurmd", "-C"], capture_output=True, text=True, timeout=60).stdout
    first = out.splitlines()[0] if out else f"NodeName={hostname} CPUs={os.cpu_count() or 1}"
    fields = dict(item.split("=", 1) for item in first.split() if "=" in item)
    memory = int(fields.get("RealMemory", "1024"))
    return (f"NodeName={hostname} NodeAddr=127.0.0.1 CPUs={fields.get('CPUs', os.cpu_count())} "
            f"RealMemory={memory} State=UNKNOWN")


def _slurm_conf(root: Path, hostname: str, ports: tuple[int, int]) -> str:
    return "\n".join([
        "ClusterName=taco-test",
        f"SlurmctldHost={hostname}(127.0.0.1)",
        f"SlurmctldPort={ports[0]}",
        f"SlurmdPort={ports[1]}",
        "SlurmUser=root", "SlurmdUser=root",
        "AuthType=auth/munge", "CredType=cred/munge",
        f"AuthInfo=socket={root / 'munge' / 'munge.socket'}",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool'}",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}", f"SlurmdPidFile={root / 'slurmd.pid'}",
        f"SlurmctldLogFile={root / 'slurmctld.log'}", f"SlurmdLogFile={root / 'slurmd.log'}",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
        "SchedulerType=sched/backfill", "MpiDefault=none",
        "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
        # Job ids start somewhere new each time: a restarted Slurm reusing ids 1, 2, ... gives a new job the PMI
        # names of an old one, and mpich then attaches to the old job's /dev/shm segment if a killed rank left
        # it (seen: the engines of a reused job id never came up).
        f"FirstJobId={random.randrange(10_000, 1_000_000)}",
        "ReturnToService=2", "SlurmdTimeout=60", "InactiveLimit=0", "KillWait=5", "MinJobAge=2",
        "SlurmctldDebug=info", "SlurmdDebug=info",
        _node_line(hostname),
        f"PartitionName={PARTITION} Nodes={hostname} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO",
        "",
    ])


@dataclass
class SlurmCluster:
    """A running private Slurm: its directory, config and daemons (by PID)."""

    root: Path
    conf: Path
    hostname: str
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    started_in: float = 0.0  # seconds from the first daemon's start to the node idle in sinfo

    @property
    def env(self) -> dict[str, str]:
        """This process's environment with ``SLURM_CONF`` pointing here (for client commands)."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=timeout)

    def active_jobs(self) -> str:
        """``squeue``'s jobs, one ``ID STATE`` a line; empty when none is left."""
        return self.run("squeue", "-h", "-o", "%i %T").stdout.strip()

    def active_jobs_after(self, timeout: float = 15.0) -> str:
        """:meth:`active_jobs` once none is left or ``timeout`` s have passed: a job whose allocation ended by
        itself (``salloc``'s command exited) stays COMPLETING until slurmd has run its epilog and told slurmctld,
        which on a loaded machine is seen by ``squeue`` after ``salloc`` has already returned."""
        return _once_empty(self.active_jobs, timeout)

    def node_state(self) -> str:
        out = self.run("sinfo", "-h", "-N", "-o", "%T").stdout.strip()
        return out.splitlines()[0].strip() if out else ""

    def log(self, name: str, lines: int = 20) -> str:
        path = self.root / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stepds(self) -> list[int]:
        """slurmstepd processes of this Slurm (they daemonize away from slurmd; its SLURM_CONF proves them ours)."""
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if not f.read().startswith(b"slurmstepd"):
                        continue
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if f"SLURM_CONF={self.conf}".encode() in f.read().split(b"\0"):
                        found.append(int(pid))
            except OSError:
                continue
        return found

    def stop(self) -> None:
        """Cancel every job left (a failed test's), SIGTERM each daemon by PID (slurmd first, munged last),
        SIGKILL what is left after 10 s, then any slurmstepd of this Slurm that outlived its slurmd."""
        if self.processes.get("slurmctld") is not None and self.processes["slurmctld"].poll() is None:
            jobs = self.run("squeue", "-h", "-o", "%i").stdout.split()
            if jobs:
                self.run("scancel", *jobs)
                deadline = time.monotonic() + 20
                while self.run("squeue", "-h", "-o", "%i").stdout.split() and time.monotonic() < deadline:
                    time.sleep(0.25)
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.processes.get(name)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        self.processes.clear()
        for pid in self.stepds():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def job_processes(job_id: str) -> list[str]:
    """Live processes of a job: its tasks (SLURM_JOB_ID in their environment) and slurmstepd for it."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
            if proc.environ().get("SLURM_JOB_ID") == job_id or f"slurmstepd: [{job_id}." in cmd:
                found.append(f"{proc.pid} {cmd}")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def job_processes_after(job_id: str, timeout: float = 15.0) -> list[str]:
    """:func:`job_processes` once they are gone or ``timeout`` s have passed: slurmstepd reaps the tasks after
    the job's state is already CANCELLED."""
    return _once_empty(lambda: job_processes(job_id), timeout)


def _once_empty(read: Callable[[], T], timeout: float) -> T:
    """``read()`` polled until it is empty or ``timeout`` s have passed: what is left, for the test to show."""
    deadline = time.monotonic() + timeout
    while (left := read()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _daemon_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != SESSION_ENV and not k.startswith("SLURM_")}
    return env


def _start(cluster: SlurmCluster, name: str, args: list[str]) -> None:
    log = open(cluster.root / f"{name}.out", "wb")  # noqa: SIM115 - the daemon owns it
    with log:
        cluster.processes[name] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                   env={**_daemon_env(), "SLURM_CONF": str(cluster.conf)},
                                                   start_new_session=True)


def _wait(cluster: SlurmCluster, what: str, ready: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, proc in cluster.processes.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({proc.returncode}) while waiting for {what}:\n"
                                   + (cluster.root / f"{name}.out").read_text(errors="replace")[-1500:]
                                   + "\n" + cluster.log(name))
        if ready():  # type: ignore[operator]
            return
        time.sleep(0.2)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}:\n{cluster.log('slurmctld')}\n"
                       f"{cluster.log('slurmd')}")


def start_slurm(root: Path, timeout: float = 60.0) -> SlurmCluster:
    """Configure and start munged, slurmctld and slurmd under ``root``; return once the node is idle."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    for sub in ("munge", "state", "spool"):
        (root / sub).mkdir(mode=0o700, exist_ok=True)
    hostname = socket.gethostname().split(".")[0]
    conf = root / "slurm.conf"
    conf.write_text(_slurm_conf(root, hostname, (_free_port(), _free_port())))
    os.chmod(conf, 0o600)  # read by the daemons and by root's clients only
    key = root / "munge" / "munge.key"
    subprocess.run([_which("mungekey") or "mungekey", "--create", f"--keyfile={key}"], check=True,
                   capture_output=True, timeout=30)
    os.chmod(key, 0o600)
    cluster = SlurmCluster(root, conf, hostname)
    began = time.monotonic()
    try:
        m = root / "munge"
        _start(cluster, "munged", [_which("munged") or "munged", "--foreground", "--force",
                                   f"--socket={m / 'munge.socket'}", f"--key-file={key}",
                                   f"--pid-file={m / 'munged.pid'}", f"--log-file={root / 'munged.log'}",
                                   f"--seed-file={m / 'munged.seed'}"])
        _wait(cluster, "munged's socket", lambda: (m / "munge.socket").exists(), timeout)
        _start(cluster, "slurmctld", [_which("slurmctld") or "slurmctld", "-D", "-i", "-f", str(conf)])
        _start(cluster, "slurmd", [_which("slurmd") or "slurmd", "-D", "-f", str(conf)])
        _wait(cluster, f"node {hostname} idle in sinfo", lambda: cluster.node_state() == "idle", timeout)
    except BaseException:
        cluster.stop()
        raise
    cluster.started_in = time.monotonic() - began
    return cluster


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    """A private Slurm for the module's tests, ``SLURM_CONF`` set in ``os.environ`` meanwhile; skips when it
    cannot run here (not root, packages not installable), saying why."""
    why = slurm_unavailable()
    if why is not None:
        pytest.skip(why)
    root = Path(tempfile.mkdtemp(prefix="taco-slurm-"))
    cluster = start_slurm(root)
    before = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.conf)
    try:
        yield cluster
    finally:
        if before is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = before
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    reason = slurm_unavailable()
    if reason:
        raise SystemExit(reason)
    where = Path(tempfile.mkdtemp(prefix="taco-slurm-"))
    running = start_slurm(where)
    try:
        print(f"node {running.hostname} idle in sinfo {running.started_in:.2f} s after munged started")
        print(running.run("sinfo").stdout)
    finally:
        running.stop()
        shutil.rmtree(where, ignore_errors=True)
