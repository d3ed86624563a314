"""The slurm profile's launchers against a real Slurm (tests/support/slurm.py: munged, slurmctld, one slurmd, no
cgroups).

Engine ids are checked against MPI ranks (mpi4py's COMM_WORLD under ``srun --mpi=pmi2``) and Slurm task ids
(``SLURM_PROCID``): all three agree. After each stop, squeue and the process table must show nothing of the job.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from traitlets.config import Config

from taco_notebook.cluster.launch.mpi import find_mpi
from taco_notebook.cluster.launch.slurm import launchers as slurm_launchers
from taco_notebook.cluster.launch.slurm import options as slurm_profile
from taco_notebook.cluster.launch.slurm.launchers import (
    SlurmBatchEngineSetLauncher,
    SrunEngineSetLauncher,
    engine_launcher,
    wait_for_engines,
)
from taco_notebook.cluster.launch.slurm.options import SlurmError, SlurmOptions

from ...support.slurm import PARTITION, SlurmCluster, job_processes_after

ENGINE_CMD = [sys.executable, "-m", "taco_notebook.engine.rankwrap",
              sys.executable, "-m", "ipyparallel.engine"]


def _engine_env() -> dict[str, str]:
    return {**find_mpi().environment, "UCX_TLS": "self,sm", "OMP_NUM_THREADS": "1"}


def _cluster(tmp_path: Path, options: SlurmOptions, lines: list[str], engine_cmd: list[str]) -> Any:
    import ipyparallel as ipp

    config = slurm_launchers.configure(Config(), SlurmBatchEngineSetLauncher, options, engine_cmd, _engine_env(),
                                     progress=lines.append)
    config.SlurmBatchEngineSetLauncher.poll_interval = 0.3
    profile = tmp_path / "profile"
    profile.mkdir(mode=0o700)
    return ipp.Cluster(engines=SlurmBatchEngineSetLauncher, n=2, controller_ip="127.0.0.1", config=config,
                       profile_dir=str(profile), log_level=logging.WARNING)


@pytest.fixture
def controller(tmp_path: Path) -> Iterator[Any]:
    """A factory: an ipyparallel controller with Slurm engines, stopped (engines, then controller) at the end."""
    made: list[Any] = []

    def make(options: SlurmOptions, lines: list[str], start_controller: bool = True,
             engine_cmd: list[str] = ENGINE_CMD) -> Any:
        cluster = _cluster(tmp_path, options, lines, engine_cmd)
        made.append(cluster)
        if start_controller:
            cluster.start_controller_sync()
        return cluster

    yield make
    for cluster in made:
        try:
            cluster.stop_engines_sync()
        finally:
            cluster.stop_controller_sync()


def _engines_fail(cluster: Any, launcher: Any, timeout: float, match: str) -> None:
    """``wait_for_engines`` for 2 engines within ``timeout`` s raises a SlurmError matching ``match`` (the client
    is closed either way)."""
    client = cluster.connect_client_sync()
    try:
        with pytest.raises(SlurmError, match=match):
            wait_for_engines(client, launcher, 2, timeout=timeout)
    finally:
        client.close()


def _info() -> dict[str, Any]:
    import os

    from mpi4py import MPI

    return {"rank": MPI.COMM_WORLD.rank, "size": MPI.COMM_WORLD.size, "task": int(os.environ["SLURM_PROCID"]),
            "job": os.environ["SLURM_JOB_ID"], "pid": os.getpid(),
            "sum": MPI.COMM_WORLD.allreduce(MPI.COMM_WORLD.rank + 1)}


def test_private_slurm_is_up(slurm: SlurmCluster) -> None:
    assert slurm.node_state() == "idle"
    assert os.stat(slurm.root).st_mode & 0o777 == 0o700
    assert os.stat(slurm.conf).st_mode & 0o777 == 0o600
    assert slurm.started_in < 60
    print(f"private Slurm: node idle in sinfo {slurm.started_in:.2f} s after munged started")


def test_sbatch_job_runs_engines_as_mpi_ranks_and_stop_cancels_it(slurm: SlurmCluster, controller) -> None:
    lines: list[str] = []
    cluster = controller(SlurmOptions(partition=PARTITION, time="10"), lines)
    began = time.monotonic()
    cluster.start_engines_sync()
    launcher = next(iter(cluster.engines.values()))
    client = cluster.connect_client_sync()
    try:
        wait_for_engines(client, launcher, 2, timeout=90)
        print(f"sbatch to 2 engines registered: {time.monotonic() - began:.1f} s")
        infos = client[:].apply_sync(_info)
    finally:
        client.close()
    job = launcher.job_id
    assert [i["rank"] for i in infos] == client.ids == [0, 1]
    assert [i["task"] for i in infos] == [0, 1]
    assert {i["size"] for i in infos} == {2} and {i["sum"] for i in infos} == {3}
    assert {i["job"] for i in infos} == {job}
    assert lines[0] == f"job {job} submitted: 2 engine tasks"
    assert f"job {job} RUNNING on {slurm.hostname}" in lines
    script = Path(launcher.batch_file).read_text()
    assert f"#SBATCH --partition={PARTITION}" in script and "#SBATCH --time=10" in script
    assert "--gres" not in script and "srun --mpi=pmi2" in script

    cluster.stop_engines_sync()
    assert lines[-1] == f"job {job} CANCELLED"
    assert slurm.active_jobs() == ""
    assert job_processes_after(job) == []
    assert not any(psutil.pid_exists(i["pid"]) for i in infos)


def test_bad_partition_is_refused_with_sbatch_message(slurm: SlurmCluster, controller) -> None:
    cluster = controller(SlurmOptions(partition="no-such-partition"), [], start_controller=False)
    with pytest.raises(SlurmError, match=r"Slurm rejected the engines' job \(2 tasks\): sbatch failed: "
                                         r"sbatch: error: .*[Ii]nvalid partition"):
        cluster.start_engines_sync()
    assert slurm.active_jobs() == ""


def test_job_cancelled_while_pending_is_reported(slurm: SlurmCluster, controller) -> None:
    lines: list[str] = []
    cluster = controller(SlurmOptions(sbatch_args=("--begin=now+1hour",)), lines)
    cluster.start_engines_sync()
    launcher = next(iter(cluster.engines.values()))
    job = launcher.job_id
    deadline = time.monotonic() + 20
    while f"job {job} PENDING (BeginTime)" not in lines and time.monotonic() < deadline:
        time.sleep(0.1)
    assert f"job {job} PENDING (BeginTime)" in lines
    slurm.run("scancel", job)  # someone else (an admin, the user in a terminal) cancels it
    _engines_fail(cluster, launcher, 30, f"the engines' Slurm job {job} CANCELLED before the cluster was stopped")
    assert slurm.active_jobs() == ""


def test_queue_timeout_cancels_the_job(slurm: SlurmCluster, controller) -> None:
    lines: list[str] = []
    cluster = controller(SlurmOptions(queue_timeout=2, sbatch_args=("--begin=now+1hour",)), lines)
    cluster.start_engines_sync()
    launcher = next(iter(cluster.engines.values()))
    _engines_fail(cluster, launcher, 30, r"PENDING \(BeginTime\) for \d+ s \(queue timeout 2 s\): cancelled it")
    assert slurm_profile.job_state(launcher.job_id).state == "CANCELLED"
    assert slurm.active_jobs() == ""


def test_job_whose_engines_fail_is_reported_with_its_output(slurm: SlurmCluster, controller) -> None:
    lines: list[str] = []
    failing = [sys.executable, "-c", "import sys; print('engine cannot start: no GPU driver', file=sys.stderr); "
               "sys.exit(3)"]
    cluster = controller(SlurmOptions(), lines, engine_cmd=failing)
    cluster.start_engines_sync()
    launcher = next(iter(cluster.engines.values()))
    _engines_fail(cluster, launcher, 60, rf"(?s)job {launcher.job_id} FAILED.* before the cluster was stopped "
                                         r"\(an engine task failed.*engine cannot start: no GPU driver")
    assert any(line.startswith(f"job {launcher.job_id} FAILED") for line in lines), lines
    assert slurm.active_jobs() == ""


def test_running_job_without_engines_times_out(slurm: SlurmCluster, controller) -> None:
    lines: list[str] = []
    silent = [sys.executable, "-c", "import time; time.sleep(600)"]  # runs, never registers
    cluster = controller(SlurmOptions(), lines, engine_cmd=silent)
    cluster.start_engines_sync()
    launcher = next(iter(cluster.engines.values()))
    _engines_fail(cluster, launcher, 3, f"job {launcher.job_id} RUNNING for 3 s but only 0 of 2 engines")
    cluster.stop_engines_sync()
    assert lines[-1] == f"job {launcher.job_id} CANCELLED"
    assert slurm.active_jobs() == ""
    assert job_processes_after(launcher.job_id) == []


INSIDE = """
import json, logging, sys
import ipyparallel as ipp
from traitlets.config import Config
from taco_notebook.cluster.launch.slurm import launchers as slurm_launchers, options as slurm
cls = slurm_launchers.engine_launcher()
config = slurm_launchers.configure(Config(), cls, slurm.SlurmOptions(), json.loads(sys.argv[1]),
                                   json.loads(sys.argv[2]))
c = ipp.Cluster(engines=cls, n=2, controller_ip="127.0.0.1", config=config, profile_dir=sys.argv[3],
                log_level=logging.WARNING)
try:
    c.start_controller_sync(); c.start_engines_sync()
    client = c.connect_client_sync()
    try:
        client.wait_for_engines(2, timeout=90)
    except TimeoutError:
        print(next(iter(c.engines.values())).get_output(remove=False)[-3000:], file=sys.stderr)
        raise
    import os
    def info():
        import os
        from mpi4py import MPI
        env = os.environ
        return MPI.COMM_WORLD.rank, int(env["SLURM_PROCID"]), env["SLURM_JOB_ID"], env["SLURM_STEP_ID"]
    print(json.dumps({"class": cls.__name__, "job": os.environ["SLURM_JOB_ID"], "ids": client.ids,
                      "infos": client[:].apply_sync(info)}))
    # as TacoCluster stops: engines asked to exit first (MPI_Finalize removes MPI's /dev/shm segment), so srun
    # ends by itself; stop_engines then only has a finished step to reap
    client.shutdown(targets="all", block=True)
    next(iter(c.engines.values())).process.wait(timeout=30)
    client.close()
finally:
    c.stop_engines_sync(); c.stop_controller_sync()
"""


@pytest.mark.parametrize("kernel_in", [["salloc", "-n", "2"], ["salloc", "-n", "2", "srun", "-n", "1"]],
                         ids=["allocation", "job-step"])
def test_inside_an_allocation_engines_are_a_job_step(slurm: SlurmCluster, tmp_path: Path,
                                                     kernel_in: list[str]) -> None:
    """The kernel under salloc (engines: step 0), or itself in a step as `srun --pty jupyter` would be (engines:
    step 1, which needs --overlap: without it the nested srun waits for CPUs its own step holds)."""
    profile = tmp_path / "profile"
    profile.mkdir(mode=0o700)
    done = slurm.run(*kernel_in, sys.executable, "-c", INSIDE, json.dumps(ENGINE_CMD),
                     json.dumps(_engine_env()), str(profile), timeout=150)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["class"] == "SrunEngineSetLauncher"
    assert result["ids"] == [0, 1]
    step = "1" if "srun" in kernel_in else "0"
    assert [tuple(i) for i in result["infos"]] == [(0, 0, result["job"], step), (1, 1, result["job"], step)]
    assert slurm.active_jobs_after() == ""  # salloc has returned; the job may still be COMPLETING a moment
    assert job_processes_after(result["job"]) == []


def test_launcher_choice_follows_the_allocation() -> None:
    assert engine_launcher({"SLURM_JOB_ID": "12"}) is SrunEngineSetLauncher
    assert engine_launcher({}) is SlurmBatchEngineSetLauncher


def test_gres_only_when_gpus_are_asked_for(tmp_path: Path) -> None:
    assert SlurmOptions(nodes=2, gpus_per_node=4).directives() == ["#SBATCH --nodes=2", "#SBATCH --gres=gpu:4"]
    assert SlurmOptions(gpus_per_node=0).directives() == []
    config = slurm_launchers.configure(Config(), SlurmBatchEngineSetLauncher, SlurmOptions(gpus_per_node=8, nodes=2))
    launcher = SlurmBatchEngineSetLauncher(config=config, profile_dir=str(tmp_path), cluster_id="c1")
    launcher.write_batch_script(16)
    script = Path(launcher.batch_file).read_text()
    assert "#SBATCH --ntasks=16" in script and "#SBATCH --gres=gpu:8" in script and "#SBATCH --nodes=2" in script
    assert os.stat(Path(launcher.batch_file).parent).st_mode & 0o777 == 0o700
    for bad in ({"gpus_per_node": -1}, {"nodes": 1.5}, {"queue_timeout": 0}, {"partition": "a b"}):
        with pytest.raises(ValueError):
            SlurmOptions(**bad)  # type: ignore[arg-type]


def test_missing_sbatch_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no Slurm client here
    launcher = SlurmBatchEngineSetLauncher(profile_dir=str(tmp_path), cluster_id="c1")
    with pytest.raises(SlurmError, match="sbatch not found on PATH: run this where Slurm's client commands"):
        launcher.start(2)
    assert not launcher.job_id
    done = subprocess.run([sys.executable, "-c", "import taco_notebook.cluster.launch.slurm.options, sys; "
                           "print(sorted({'IPython', 'ipyparallel'} & set(sys.modules)))"],
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "[]", done.stderr  # options and queue state import neither
