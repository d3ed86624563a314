"""The slurm profile's job options on the magics (``--partition``, ``--time``, ``--nodes``, ``--gpus-per-node``,
``--queue-timeout`` and their traits), checked before anything starts and seen in the job a real Slurm runs.

The job tests use tests/support/slurm.py's private Slurm (munged, slurmctld, one slurmd; root only, skipped otherwise):
what ``scontrol show job`` and ``squeue`` report of the submitted job is compared with the options given.
"""

from __future__ import annotations

import time

import pytest
from IPython.core.error import UsageError

from taco_notebook.cluster.launch.profiles import ProfileError, profile_for
from taco_notebook.cluster.launch.slurm.options import SlurmError, SlurmOptions, check_time
from taco_notebook.cluster.session import clusters

from ...conftest import assert_trait_refused, session_processes
from ...support.slurm import PARTITION, SlurmCluster, slurm  # noqa: F401 - the fixture

SLURM_TRAITS = ("partition", "time", "nodes", "gpus_per_node", "queue_timeout")


def _reset(ip) -> None:
    magics = ip.magics_manager.registry["TacoMagics"]
    magics.config.pop("TacoMagics", None)  # or the next %config would load these values again
    for name in (*SLURM_TRAITS, "controller_ip", "profile"):
        setattr(magics, name, None)


def test_time_limits_in_slurms_formats() -> None:
    for good in ("5", "90", "5:30", "1:00:00", "36:00:00", "2-0", "2-12", "1-2:30", "1-02:03:04"):
        assert check_time(good) == good
    for bad in ("", "5m", "1h", "-1", "1:60", "1:00:60", "1:2:3:4", "1-24", "1-2:60", "1-", "1:", "1-2-3"):
        with pytest.raises(ValueError, match=r"--time .* is not a Slurm time limit: give MM, MM:SS, HH:MM:SS, "
                                             r"D-HH, D-HH:MM or D-HH:MM:SS"):
            check_time(bad)
    with pytest.raises(ValueError, match="not a Slurm time limit"):
        SlurmOptions(time="10 min")
    assert SlurmOptions(partition="gpu", time="30", gpus_per_node=8, queue_timeout=60.0).flags() == \
        "--partition gpu --time 30 --gpus-per-node 8 --queue-timeout 60"


def test_profile_for_takes_the_job_only_for_slurm() -> None:
    job = SlurmOptions(partition="gpu", time="1:00:00", nodes=2, gpus_per_node=4)
    profile = profile_for("slurm", controller_ip="127.0.0.1", slurm=job)
    assert profile.slurm == job and profile_for("slurm", controller_ip="127.0.0.1").slurm == SlurmOptions()
    assert profile != profile_for("slurm", controller_ip="127.0.0.1", slurm=SlurmOptions(time="2:00:00"))
    for name in ("local", "hosts", "mpijob"):
        with pytest.raises(ProfileError, match="--partition gpu .* are for --profile slurm"):
            profile_for(name, hosts="localhost:2" if name == "hosts" else None, slurm=job)


@pytest.mark.parametrize("line, message", [
    ("--partition taco -np 2", "--partition is for --profile slurm .* profile is local"),
    ("--profile hosts --hosts localhost:2 --time 5 -np 2", "--time is for --profile slurm .* profile is hosts"),
    ("--hosts localhost:2 --gpus-per-node 1 -np 2", "--gpus-per-node is for --profile slurm"),
    ("--profile local --queue-timeout 30 -np 2", "--queue-timeout is for --profile slurm"),
    ("--profile slurm --time 5m -np 2", r"--time '5m' is not a Slurm time limit: give MM, MM:SS"),
    ("--profile slurm --time 1:75 -np 2", "is not a Slurm time limit"),
    ("--profile slurm --gpus-per-node -1 -np 2", "--gpus-per-node must be a whole number >= 0"),
    ("--profile slurm --nodes 0 -np 2", "--nodes must be a positive integer"),
    ("--profile slurm --queue-timeout 0 -np 2", "--queue-timeout must be a positive number of seconds"),
])
def test_bad_job_options_are_usage_errors_and_start_nothing(ip, line: str, message: str) -> None:
    before = session_processes()
    ip.run_line_magic("config", "TacoMagics.controller_ip = '127.0.0.1'")
    try:
        with pytest.raises(UsageError, match=message):
            ip.run_cell_magic("taco_run", f"{line} --cluster badslurm", "1")
        with pytest.raises(UsageError, match=message):
            ip.run_line_magic("taco_cluster", f"start {line.replace('-np', '-n')} --cluster badslurm")
    finally:
        _reset(ip)
    assert "badslurm" not in clusters and session_processes() == before


@pytest.mark.parametrize("line, message", [
    ('TacoMagics.time = "5x"', "TacoMagics.time '5x' is not a Slurm time limit"),
    ("TacoMagics.gpus_per_node = -1", "TacoMagics.gpus_per_node must be a whole number >= 0"),
    ("TacoMagics.queue_timeout = 0", "TacoMagics.queue_timeout must be a positive number of seconds"),
    ('TacoMagics.partition = "a b"', "TacoMagics.partition must be a Slurm partition name"),
])
def test_a_bad_job_trait_is_refused_naming_it(ip, caplog, line: str, message: str) -> None:
    try:
        assert_trait_refused(ip, caplog, line, message, SLURM_TRAITS)
    finally:
        _reset(ip)


def _job_ids(slurm: SlurmCluster) -> set[str]:  # noqa: F811
    """Every job slurmctld still knows of, finished ones included."""
    return set(slurm.run("squeue", "-h", "-t", "all", "-o", "%i").stdout.split())


def _job(slurm: SlurmCluster, job_id: str) -> tuple[dict[str, str], str]:  # noqa: F811
    """``scontrol show job``'s fields and ``squeue``'s partition|time limit of the job."""
    shown = slurm.run("scontrol", "show", "job", job_id).stdout
    fields = dict(item.split("=", 1) for item in shown.split() if "=" in item)
    return fields, slurm.run("squeue", "-h", "-j", job_id, "-o", "%P|%l").stdout.strip()


@pytest.mark.timeout(400, method="signal")
def test_job_options_reach_the_job_and_a_change_restarts_it(ip, slurm, capsys,  # noqa: F811
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_TLS", "self,sm")  # the test Slurm's one node is this machine; sbatch exports it
    ip.run_line_magic("config", "TacoMagics.controller_ip = '127.0.0.1'")
    jobs: list[str] = []
    try:
        began = time.monotonic()
        ip.run_line_magic("taco_cluster", f"start --profile slurm -n 2 --partition {PARTITION} --time 5 "
                                          f"--gpus-per-node 0 --cluster slurmjob")
        started = time.monotonic() - began
        cluster = clusters["slurmjob"]
        jobs.append(cluster._sets.launchers[0].job_id)
        first, first_queue = _job(slurm, jobs[0])
        ranks = ip.run_cell_magic("taco_run", f"--profile slurm --partition {PARTITION} --time 5 -np 2 --gather "
                                              f"--cluster slurmjob --no-dashboard", "taco.rank()")
        assert clusters["slurmjob"] is cluster  # the same job options: the running cluster serves the cell
        # the time limit as a trait (a settings file's c.TacoMagics.time): another job, so a restart
        ip.run_line_magic("config", 'TacoMagics.time = "0-00:07"')
        ip.run_line_magic("taco_cluster", f"start --profile slurm -n 2 --partition {PARTITION} --cluster slurmjob")
        jobs.append(clusters["slurmjob"]._sets.launchers[0].job_id)
        second, second_queue = _job(slurm, jobs[1])
        first_after = slurm.run("squeue", "-h", "-j", jobs[0], "-o", "%T").stdout.strip()
    finally:
        _reset(ip)
        if "slurmjob" in clusters:
            ip.run_line_magic("taco_cluster", "stop --cluster slurmjob")
    captured = capsys.readouterr()
    out = captured.out + captured.err  # the restart's warning goes to stderr
    with capsys.disabled():
        print(f"\nslurm job with --partition/--time/--gpus-per-node 0: start {started:.1f} s; "
              f"squeue %P|%l: {first_queue!r}, then {second_queue!r} after the restart")
    assert ranks == [0, 1]
    assert (first["Partition"], first["TimeLimit"], first_queue) == (PARTITION, "00:05:00", f"{PARTITION}|5:00")
    assert "gres/gpu" not in first.get("TRES", "") and first.get("TresPerNode", "(null)") in ("(null)", "")
    assert f"cluster 'slurmjob' asks Slurm for another job; restarting it with --partition {PARTITION} " \
           f"--time 0-00:07" in out
    assert jobs[1] != jobs[0] and first_after in ("", "CANCELLED", "COMPLETING")
    assert (second["Partition"], second["TimeLimit"], second_queue) == (PARTITION, "00:07:00", f"{PARTITION}|7:00")
    assert slurm.run("squeue", "-h", "-o", "%i %T").stdout.strip() == ""


def test_bad_partition_is_slurms_error_and_queues_nothing(ip, slurm) -> None:  # noqa: F811
    before, known = session_processes(), _job_ids(slurm)
    ip.run_line_magic("config", "TacoMagics.controller_ip = '127.0.0.1'")
    try:
        with pytest.raises(SlurmError, match=r"Slurm rejected the engines' job \(2 tasks\): sbatch failed: "
                                             r"sbatch: error: .*[Ii]nvalid partition"):
            ip.run_line_magic("taco_cluster", "start --profile slurm -n 2 --partition no-such-partition "
                                              "--cluster badpartition")
    finally:
        _reset(ip)
    assert "badpartition" not in clusters and _job_ids(slurm) <= known
    deadline = time.monotonic() + 15  # the controller ipyparallel started is stopped with the failed start
    while session_processes() != before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert session_processes() == before


def test_bad_time_is_refused_before_anything_is_submitted(ip, slurm) -> None:  # noqa: F811
    before, known = session_processes(), _job_ids(slurm)
    ip.run_line_magic("config", "TacoMagics.controller_ip = '127.0.0.1'")
    try:
        with pytest.raises(UsageError, match="--time '90min' is not a Slurm time limit"):
            ip.run_line_magic("taco_cluster", f"start --profile slurm -n 2 --partition {PARTITION} --time 90min "
                                              f"--cluster badtime")
    finally:
        _reset(ip)
    assert "badtime" not in clusters and session_processes() == before and _job_ids(slurm) <= known
