"""A rank killed, stopped or failing at any stage leaves no taco segment in /dev/shm, and a name that killed
ranks left is removed by the next segment made on the node, only where it is provably this user's and orphaned.

Real ranks: ``mpiexec`` runs tests/mpi/shm_faults.py, where one rank faults at a stage; plain processes in a
gloo group run tests/mpi/shm_late.py, where a rank opens the segment after its maker died (MPI would end the
job for us before we could look). /dev/shm is checked after each job for the names its own ranks could make: a
segment name carries its maker's pid.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from taco_notebook.cluster.processes.tree import mapped_shared_memory
from taco_notebook.comm.transport import shmfile
from taco_notebook.comm.transport.peers import started

from ..support.mpirun import SCRIPTS, kill_session, mpi_env, started_by

SHM = "/dev/shm"
NAME = re.compile(r"taco-\d+-[0-9a-f]{32}-\d+-(\d+)-\d+-.+")  # group 1: the maker's pid
STAGES = ["before", "create", "mid", "after"]
FAULTS = ["kill", "stop", "raise"]


@dataclass
class Job:
    returncode: int
    output: str
    pids: set[int]  # every rank's
    named_while_stopped: set[str]  # its segments' names in /dev/shm while its victim was stopped


def _named_by(pids: set[int]) -> set[str]:
    """The taco segments in /dev/shm made by one of ``pids``."""
    return {name for name in os.listdir(SHM) if (found := NAME.fullmatch(name)) and int(found[1]) in pids}


def _remove_mpi_leftovers(paths: set[str]) -> None:
    """MPI's own segments that the job's ranks mapped and no live process maps now (a killed rank leaves them)."""
    left = {path for path in paths if os.path.exists(path)}
    for path in left - mapped_shared_memory(psutil.process_iter()):
        Path(path).unlink(missing_ok=True)


def _run(mpiexec: str, n: int, args: list[str], timeout: float = 150) -> Job:
    """``mpiexec -n N shm_faults.py ARGS`` to its end; a stopped victim's job is killed (SIGKILL to every
    process of it, as a cluster's stop ends what ignores SIGTERM) once the victim is stopped."""
    if NAME.fullmatch(shmfile.segment_name("probe")) is None:
        pytest.skip("this process cannot name its owner (/proc, boot id): segments are not attributable")
    proc = subprocess.Popen([mpiexec, "-n", str(n), sys.executable, str(SCRIPTS / "shm_faults.py"), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=mpi_env({"MPIR_CVAR_NOLOCAL": "1"}))
    lines: list[str] = []
    stdout = proc.stdout
    assert stdout is not None
    reader = threading.Thread(target=lambda: lines.extend(iter(stdout.readline, "")), daemon=True)
    reader.start()
    pids: set[int] = set()
    mapped: set[str] = set()
    named: set[str] = set()
    try:
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            if args[0] == "stop" and _stopped(lines):
                time.sleep(1.0)  # the others reach their wait for it
                named = _named_by({int(line.split()[2]) for line in list(lines) if line.startswith("PID ")})
                for process in started_by(proc):
                    process.kill()
            time.sleep(0.05)
        if proc.poll() is None:
            kill_session(proc)
            pytest.fail(f"shm_faults.py {' '.join(args)} overran {timeout:g} s:\n{''.join(lines)}")
        proc.wait()
    finally:
        if proc.returncode is None:
            kill_session(proc)
        reader.join(10)
        for line in list(lines):
            if line.startswith("PID "):
                pids.add(int(line.split()[2]))
                mapped.update(line.split()[3:])
        _remove_mpi_leftovers(mapped)
    return Job(proc.returncode, "".join(lines), pids, named)


def _stopped(lines: list[str]) -> bool:
    """Whether the victim said it faults and is stopped now."""
    ranks = {line.split()[1] for line in list(lines) if line.startswith("FAULT ")}
    pids = [int(line.split()[2]) for line in list(lines) if line.startswith("PID ") and line.split()[1] in ranks]
    try:
        return any(psutil.Process(pid).status() == psutil.STATUS_STOPPED for pid in pids)
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("victim", [0, 1])
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("fault", FAULTS)
def test_a_faulty_rank_leaves_no_segment(mpiexec, fault, stage, victim):
    """kill -9, SIGSTOP then the job killed, or an exception, on the maker (local rank 0) or another rank, before
    the first collective, while a segment is made, mid-collective (segments growing) or after: once the job is
    gone, no segment of it is in /dev/shm (none ever had a name)."""
    job = _run(mpiexec, 2, [fault, stage, str(victim)])
    assert f"FAULT {victim}" in job.output and len(job.pids) == 2, job.output[-3000:]
    assert job.returncode != 0, job.output[-3000:]
    assert _named_by(job.pids) == set(), job.output[-3000:]


@pytest.mark.parametrize(("fault", "stage", "victim"), [
    ("stop", "create", 0), ("kill", "create", 2), ("raise", "create", 2), ("kill", "mid", 0), ("stop", "mid", 2)])
def test_names_left_by_killed_ranks_go_with_the_next_segment(mpiexec, fault, stage, victim):
    """Where the ranks open the segment by its name (no rank may open another's fd), a job killed while the
    name lives leaves it, and the next job's segment removes it: its maker is dead. A maker stopped as it
    offers the segment holds a name for certain, which no other job on the node (they run reclaims too) may
    remove while the maker lives."""
    job = _run(mpiexec, 3, [fault, stage, str(victim), "by-path"])
    assert f"FAULT {victim}" in job.output and len(job.pids) == 3, job.output[-3000:]
    if (fault, stage, victim) == ("stop", "create", 0):
        assert job.named_while_stopped, job.output[-3000:]
    after = _run(mpiexec, 2, ["none", "after", "0"])
    assert after.returncode == 0 and after.output.count("DONE") == 2, after.output[-3000:]
    assert _named_by(job.pids | after.pids) == set(), after.output[-3000:]


@pytest.mark.parametrize("by_path", [False, True])
def test_a_rank_that_opens_a_new_segment_late_still_finds_it(mpiexec, by_path):
    """Rank 2 of 3 waits 2 s before it opens the first segment: rank 0 holds the file open (or its name) until
    every rank has mapped it, so the job finishes, with exact sums, and leaves nothing."""
    job = _run(mpiexec, 3, ["late", "create", "2", *(["by-path"] if by_path else [])])
    assert job.returncode == 0 and job.output.count("DONE") == 3, job.output[-3000:]
    assert _named_by(job.pids) == set()


def test_a_late_rank_whose_segment_maker_died_fails_clearly(tmp_path):
    """Rank 0 exits once it offered the segment, before the late rank opened it: the late rank raises at once,
    a RuntimeError (what elastic recovery catches) naming what it could not map and the lost process group."""
    store = tmp_path / "store"
    procs = [subprocess.Popen([sys.executable, str(SCRIPTS / "shm_late.py"), str(rank), "2", str(store)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for rank in range(2)]
    try:
        outputs = [proc.communicate(timeout=60)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    found = re.search(r"RAISED ([\d.]+) RuntimeError: could not map the node's shared segment \(local rank 1: .*"
                      r"\), and the node's process group failed", outputs[1])
    assert found, outputs
    assert float(found[1]) < 30, outputs[1]


# ---- fast: naming, unnamed files, reclaiming (no ranks) ------------------------------------------------------
def _identity() -> tuple[int, str, int]:
    found = re.fullmatch(r"taco-(\d+)-([0-9a-f]{32})-(\d+)-\d+-\d+-probe", shmfile.segment_name("probe"))
    if found is None:
        pytest.skip("this process cannot name its owner (/proc, boot id)")
    return int(found[1]), found[2], int(found[3])


def _dead_process() -> tuple[int, int]:
    """The pid and start time of a process of ours that has ended and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    began = started(child.pid)
    child.kill()
    child.wait()
    return child.pid, began


def test_a_segment_name_says_whose_it_is():
    uid, boot, namespace = _identity()
    name = shmfile.segment_name("abc-1")
    assert name == f"taco-{uid}-{boot}-{namespace}-{os.getpid()}-{started(os.getpid())}-abc-1"
    assert uid == os.geteuid() and boot == Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")


def test_only_this_users_orphans_are_reclaimed(tmp_path):
    """Removed: a dead maker's segment, a zombie's, one whose pid a later process has. Kept: a live maker's
    (this process), another user's uid in the name, another boot or pid namespace, a symlink, a name in the old
    form, a file another user owns."""
    uid, boot, namespace = _identity()
    dead, dead_began = _dead_process()
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    zombie_began = started(zombie.pid)
    while psutil.Process(zombie.pid).status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.01)
    me, my_start = os.getpid(), started(os.getpid())
    removed = {f"taco-{uid}-{boot}-{namespace}-{dead}-{dead_began}-a-1",
               f"taco-{uid}-{boot}-{namespace}-{zombie.pid}-{zombie_began}-a-2",
               f"taco-{uid}-{boot}-{namespace}-{me}-{my_start - 1}-a-3"}  # an earlier process under this pid
    kept = {f"taco-{uid}-{boot}-{namespace}-{me}-{my_start}-b-1",
            f"taco-{uid + 1}-{boot}-{namespace}-{dead}-{dead_began}-c-1",
            f"taco-{uid}-{'0' * 32}-{namespace}-{dead}-{dead_began}-d-1",
            f"taco-{uid}-{boot}-{namespace + 1}-{dead}-{dead_began}-e-1",
            "taco-0123456789ab-1"}
    for name in removed | kept:
        (tmp_path / name).write_bytes(b"\0" * 8)
    link = f"taco-{uid}-{boot}-{namespace}-{dead}-{dead_began}-f-1"
    (tmp_path / link).symlink_to(tmp_path / "taco-0123456789ab-1")
    kept.add(link)
    if os.geteuid() == 0:
        planted = f"taco-{uid}-{boot}-{namespace}-{dead}-{dead_began}-g-1"
        (tmp_path / planted).write_bytes(b"\0" * 8)
        os.chown(tmp_path / planted, 65534, 65534)
        kept.add(planted)
    try:
        got = shmfile.reclaim_orphans([str(tmp_path), str(tmp_path / "missing")])
    finally:
        zombie.wait()
    assert sorted(got) == sorted(str(tmp_path / name) for name in removed)
    assert set(os.listdir(tmp_path)) == kept


def test_an_unnamed_segment_leaves_no_name_and_opens_through_its_holder(tmp_path):
    """``create(named=False)`` leaves nothing in the directory; another process of this user opens it through
    ``/proc/<pid>/fd`` (here this one), and a different file under that fd is refused."""
    path, fd = shmfile.create(str(tmp_path), "taco-x-1", 4096, named=False)
    try:
        assert path == str(tmp_path / "taco-x-1") and os.listdir(tmp_path) == []
        info = os.fstat(fd)
        again = shmfile.open_held(os.getpid(), fd, info.st_dev, info.st_ino)
        os.pwrite(again, b"seen", 0)
        os.close(again)
        assert os.pread(fd, 4, 0) == b"seen"
        with pytest.raises(PermissionError, match="no longer the node's shared segment"):
            shmfile.open_held(os.getpid(), fd, info.st_dev, info.st_ino + 1)
    finally:
        os.close(fd)
    named, fd = shmfile.create(str(tmp_path), "taco-x-2", 4096, named=True)
    os.close(fd)
    assert os.listdir(tmp_path) == ["taco-x-2"] and os.path.getsize(named) == 4096
