"""Which MPI launcher a one-host cluster gets (MPICH's gforker: no network port), the overrides, and what
rankwrap adds under gforker (the local rank/size hydra would set, and the job stopped when a rank dies).

Everything runs the mpich wheel's real programs; the cluster-level behaviour (engine ids, streaming, Ctrl-C,
dead ranks, kernel shutdown) is covered by test_magics.py, test_kernel.py and test_rendezvous.py, which now run
under gforker.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from taco_notebook.cluster.launch.mpi import LAUNCHER_ENV, MPIInfo, find_mpi, for_one_host, gforker_beside
from taco_notebook.engine.rankwrap import LAUNCHED_BY_ENV, MARKER
from taco_notebook.errors import MPINotFoundError

from ...support.mpirun import run_in_session
from ...support.waiting import wait_until

BIN = Path(sys.executable).parent
GFORKER = BIN / "mpiexec.gforker"
needs_gforker = pytest.mark.skipif(not GFORKER.exists() or not (BIN / "mpiexec").exists(),
                                   reason="needs the mpich wheel's mpiexec and mpiexec.gforker beside python")


@pytest.mark.mpi
@needs_gforker
def test_one_host_takes_gforker_and_says_so(monkeypatch):
    monkeypatch.delenv(LAUNCHER_ENV, raising=False)
    info = find_mpi(single_host=True)
    assert info.mpiexec == str(GFORKER) and info.launcher == "gforker", info
    assert info.implementation == "mpich" and info.version[0].isdigit(), info
    assert "gforker" in info.description, info.description
    # same MPICH as hydra's mpiexec: same library, same environment for mpi4py
    assert info.environment == find_mpi().environment and info.environment, info


@pytest.mark.mpi
@needs_gforker
def test_overrides_hydra_by_env_and_explicit_path(monkeypatch):
    monkeypatch.setenv(LAUNCHER_ENV, "Hydra")
    assert find_mpi(single_host=True).launcher == "hydra"
    monkeypatch.setenv(LAUNCHER_ENV, "gforker")
    explicit = find_mpi(str(BIN / "mpiexec"), single_host=True)  # --mpiexec PATH: exactly that program
    assert explicit.mpiexec == str(BIN / "mpiexec") and explicit.launcher == "hydra", explicit
    named = find_mpi(str(GFORKER), single_host=True)  # --mpiexec .../mpiexec.gforker is recognised
    assert (named.implementation, named.launcher) == ("mpich", "gforker") and named.version[0].isdigit(), named
    assert find_mpi().launcher == "hydra"  # not a one-host job: never switched


@pytest.mark.mpi
@needs_gforker
def test_bad_choice_and_missing_gforker_are_clear_errors(monkeypatch, tmp_path):
    monkeypatch.setenv(LAUNCHER_ENV, "fork")
    with pytest.raises(MPINotFoundError, match=r"TACO_MPI_LAUNCHER='fork'.*auto, hydra, gforker"):
        find_mpi(single_host=True)
    lone = tmp_path / "mpiexec"  # an MPICH install without gforker
    shutil.copy(BIN / "mpiexec", lone)
    assert gforker_beside(str(lone)) is None
    hydra_only = MPIInfo(str(lone), "mpich", "5", launcher="hydra")
    assert for_one_host(hydra_only, explicit=False, environ={}) is hydra_only  # auto: hydra stays
    with pytest.raises(MPINotFoundError, match=r"no mpiexec.gforker beside .*unset TACO_MPI_LAUNCHER"):
        for_one_host(hydra_only, explicit=False, environ={LAUNCHER_ENV: "gforker"})
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "mpiexec").symlink_to(BIN / "mpiexec")  # a symlink to the wheel's: its gforker is found
    assert gforker_beside(str(linked / "mpiexec")) == str(GFORKER)


def test_open_mpi_is_left_as_it_is():
    info = MPIInfo("/opt/ompi/bin/mpiexec", "openmpi", "5.0", ["--oversubscribe"])
    assert for_one_host(info, explicit=False, environ={LAUNCHER_ENV: "gforker"}) is info


RANK = """
import os, signal, sys, time
# one write per line: print() writes each piece on its own under PYTHONUNBUFFERED, and ranks interleave them
local = os.environ.get("MPI_LOCALRANKID"), os.environ.get("MPI_LOCALNRANKS")
sys.stdout.write(f"rank {os.environ['PMI_RANK']} {local[0]} {local[1]}\\n")
sys.stdout.flush()
if os.environ["PMI_RANK"] == "1":
    time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(float(sys.argv[1]))
sys.stdout.write(f"rank {os.environ['PMI_RANK']} outlived its peer\\n")
"""


@pytest.mark.mpi
@needs_gforker
def test_rankwrap_under_gforker_sets_local_ranks_and_stops_the_job_when_a_rank_dies(tmp_path):
    """Output goes to a log file opened for append, as ipyparallel gives mpiexec the engine set's log."""
    script, log = tmp_path / "rank.py", tmp_path / "engines.log"
    script.write_text(RANK)
    env = {**os.environ, LAUNCHED_BY_ENV: "gforker"}
    began = time.monotonic()
    with open(log, "ab") as out:
        run_in_session([str(GFORKER), "-n", "3", sys.executable, "-m", "taco_notebook.engine.rankwrap",
                        sys.executable, str(script), "60"], stdout=out, env=env, timeout=120)
    took = time.monotonic() - began
    text = log.read_text()
    assert "outlived its peer" not in text, text
    assert took < 40, f"the job ran {took:.0f} s: the other ranks were not stopped"
    assert sorted(line for line in text.splitlines() if line.startswith("rank")) == [
        "rank 0 0 3", "rank 1 1 3", "rank 2 2 3"], text  # every rank is local under gforker
    markers = [line for line in text.splitlines() if line.startswith(MARKER)]
    assert len(markers) == 1 and markers[0].startswith(f"{MARKER} rank=1 "), text  # the others were SIGKILLed
    assert markers[0].endswith("signal=9") and "Error" not in text, text  # SIGKILL's handler no longer trips it


def _local_env() -> tuple[str | None, str | None, str | None]:
    import os as _os

    return _os.environ.get("PMI_RANK"), _os.environ.get("MPI_LOCALRANKID"), _os.environ.get("MPI_LOCALNRANKS")


@needs_gforker
def test_cluster_runs_under_gforker_with_engine_id_equal_to_rank(ip, shared_cluster, capsys):
    assert shared_cluster.mpi.launcher == "gforker", shared_cluster.mpi
    view = shared_cluster.view
    ids = list(shared_cluster.client.ids)
    assert view.apply_sync(_local_env) == [(str(i), str(i), "4") for i in ids]
    ip.run_line_magic("taco_cluster", "status --cluster default")
    assert "gforker" in capsys.readouterr().out


def _publish_and_pid() -> int:
    from ipyparallel.datapub import publish_data

    publish_data({"probe": 1})  # a data_message, as every dashboard payload is
    return os.getpid()


def test_the_controller_runs_with_taco_settings_and_logs_no_line_per_request(shared_cluster):
    """The controller is a process of its own: its settings go on its command line (a ``Config`` handed to
    ``ipp.Cluster`` never reaches it). With them it keeps no record of requests (NoDB) and writes no log line per
    request, reply or dashboard payload (its logger at ERROR)."""
    import psutil

    from taco_notebook.cluster.launch.engineset import CONTROLLER_CMD, controller_args

    controller = shared_cluster.ipp_cluster.controller
    command = psutil.Process(controller.process.pid).cmdline()
    assert command[1:3] == CONTROLLER_CMD[1:], command  # taco's controller (ipp/hub.py)
    assert command[-len(controller_args(4)):] == controller_args(4), command
    assert "--HeartMonitor.period=3000" in command
    before = Path(controller.output_file).read_text(errors="replace")
    completed = shared_cluster.client.queue_status()
    assert len(shared_cluster.view.apply_sync(_publish_and_pid)) == 4

    def counted() -> bool:  # the lean hub still counts every request and reply, a moment after the client has it
        now = shared_cluster.client.queue_status()
        return all(now[r]["queue"] == 0 and now[r]["completed"] == completed[r]["completed"] + 1 for r in range(4))

    wait_until(counted, 10, "the hub counting the cell's replies")
    after = Path(controller.output_file).read_text(errors="replace")
    for line in ("queue::request", "Hub using DB backend: DictDB", "unhandled iopub msg_type"):
        assert line not in after, after[-2000:]
    assert len(after) - len(before) < 200, after[len(before):]


LOUD = """
import os, sys
for i in range(100):
    sys.stderr.write(f"rank {os.environ['PMI_RANK']} line {i} " + "é…🌮" * 300 + "\\n")
    sys.stderr.flush()
sys.stdout.write(f"rank {os.environ['PMI_RANK']} done\\n")  # one write, as in RANK
sys.stdout.flush()
"""


@pytest.mark.mpi
@needs_gforker
def test_non_ascii_output_reaches_the_log_whole_under_gforker(tmp_path):
    """gforker's own relay stops at a rank's first non-ASCII byte; rankwrap writes to the log file directly,
    which is opened for append as ipyparallel opens the engine set's log."""
    script, log = tmp_path / "loud.py", tmp_path / "engines.log"
    script.write_text(LOUD)
    env = {**os.environ, LAUNCHED_BY_ENV: "gforker"}
    with open(log, "ab") as out:
        job = run_in_session([str(GFORKER), "-n", "3", sys.executable, "-m", "taco_notebook.engine.rankwrap",
                              sys.executable, str(script)], stdout=out, env=env, timeout=120)
    text = log.read_text()  # strict UTF-8: no byte lost or interleaved mid-character
    assert job.returncode == 0, text[-2000:]
    lines = text.splitlines()
    for rank in range(3):
        assert f"rank {rank} done" in lines, text[-2000:]
        expected = {f"rank {rank} line {i} " + "é…🌮" * 300 for i in range(100)}
        assert expected <= set(lines), f"rank {rank}: {len(expected - set(lines))} lines lost or cut"


@needs_gforker
@pytest.mark.cluster
def test_a_start_whose_engines_do_not_register_in_time_names_them_and_stops_everything(tmp_path):
    """Engines take seconds to import ipyparallel and register: with 1.5 s to do it, the start fails naming the
    ranks that never registered and their host (an engine's id is its MPI rank), and leaves no process behind
    (the autouse fixture fails the test on any survivor)."""
    import socket

    from taco_notebook.cluster.registry.writer import track
    from taco_notebook.cluster.session import TacoCluster
    from taco_notebook.errors import ClusterStartError

    cluster = track(TacoCluster(f"slow{os.getpid()}", 2, start_timeout=1.5), tmp_path)
    began = time.monotonic()
    with pytest.raises(ClusterStartError) as info:
        cluster.start()
    message = str(info.value)
    assert "engines registered within 1.5 s" in message, message
    host = socket.gethostname()
    assert f"never registered (ranks 0, 1 on {host})" in message or f"on {host})" in message, message
    assert time.monotonic() - began < 60
    assert not cluster.running


@needs_gforker
@pytest.mark.cluster
def test_a_start_says_how_many_engines_registered_while_it_waits(tmp_path, monkeypatch):
    """A start that waits for its engines says, every PROGRESS_EVERY_S, how many registered so far (made short
    here: 2 engines register within seconds); the counts never fall and never pass the size."""
    import re

    from taco_notebook.cluster.launch import engineset
    from taco_notebook.cluster.registry.writer import track
    from taco_notebook.cluster.session import TacoCluster

    monkeypatch.setattr(engineset, "PROGRESS_EVERY_S", 0.2)
    lines: list[str] = []
    cluster = track(TacoCluster(f"progress{os.getpid()}", 2, progress=lines.append), tmp_path)
    try:
        cluster.start()
    finally:
        cluster.stop()
    said = [re.fullmatch(r"(\d) of 2 engines registered after (\d+) s", line) for line in lines]
    assert said and all(said), lines
    counts = [int(m.group(1)) for m in said if m]
    seconds = [int(m.group(2)) for m in said if m]
    assert counts == sorted(counts) and counts[-1] <= 2, lines
    assert seconds == sorted(seconds), lines
