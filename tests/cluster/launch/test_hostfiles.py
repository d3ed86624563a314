"""``--profile mpijob``: the MPIJob's hostfile found and read (both of MPI Operator's formats), and a notebook that
attaches to the hosts it names.

The real run stands in for an MPIJob's launcher pod with emulated nodes (network namespaces with Debian's sshd,
root only, skipped otherwise): a hostfile in MPI Operator's Open MPI form names them, ``OMPI_MCA_orte_default_hostfile``
points at it as the operator sets it in the launcher, and ``%taco_cluster start --profile mpijob`` runs the ranks
there over ssh with mpich's hydra.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from IPython.core.error import UsageError

from taco_notebook.cluster.launch.hostfiles import HOSTFILE_VARIABLES, mpijob_hostfile, read_mpijob_hosts
from taco_notebook.cluster.launch.profiles import PROFILES, ProfileError, mpijob_profile, profile_for
from taco_notebook.cluster.session import clusters
from taco_notebook.emulate.hosts import EmulatedHosts

from ...conftest import session_processes
from .test_profiles import _left_on_nodes, emulated, needs_hosts  # noqa: F401 - the fixture

OPEN_MPI = "job-worker-0.job-worker.ns.svc slots=8\njob-worker-1.job-worker.ns.svc slots=8\n"
MPICH = "job-worker-0.job-worker.ns.svc:4\njob-worker-1.job-worker.ns.svc:4\n"
WORKERS = ("job-worker-0.job-worker.ns.svc", "job-worker-1.job-worker.ns.svc")


def test_both_of_the_operators_formats(tmp_path: Path) -> None:
    for text, slots in ((OPEN_MPI, 8), (MPICH, 4), ("# workers\n" + OPEN_MPI.replace("\n", "  # pod\n"), 8)):
        hostfile = tmp_path / "hostfile"
        hostfile.write_text(text)
        assert read_mpijob_hosts({"OMPI_MCA_orte_default_hostfile": str(hostfile)}) == \
            tuple((host, slots) for host in WORKERS)


def test_the_variables_in_order_then_the_mounted_file(tmp_path: Path) -> None:
    files = {}
    for name in (*HOSTFILE_VARIABLES, "mounted"):
        files[name] = tmp_path / name
        files[name].write_text("n0:1\n")
    env = {name: str(files[name]) for name in HOSTFILE_VARIABLES}
    assert mpijob_hostfile(env, str(files["mounted"])) == (str(files["OMPI_MCA_orte_default_hostfile"]),
                                                          "$OMPI_MCA_orte_default_hostfile")
    del env["OMPI_MCA_orte_default_hostfile"]
    assert mpijob_hostfile(env, str(files["mounted"]))[1] == "$I_MPI_HYDRA_HOST_FILE"
    del env["I_MPI_HYDRA_HOST_FILE"]
    assert mpijob_hostfile(env, str(files["mounted"]))[1] == "$HYDRA_HOST_FILE"
    assert mpijob_hostfile({}, str(files["mounted"])) == (str(files["mounted"]), str(files["mounted"]))
    assert read_mpijob_hosts({}, str(files["mounted"])) == (("n0", 1),)


def test_no_hostfile_says_where_the_profile_works(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match=r"--profile mpijob is for a notebook running inside a Kubeflow MPIJob.*"
                                           r"\$OMPI_MCA_orte_default_hostfile.*%taco_cluster manifest --k8s"):
        mpijob_hostfile({}, str(tmp_path / "absent"))
    with pytest.raises(ProfileError, match=r"the MPIJob's hostfile '.*gone' \(from \$HYDRA_HOST_FILE\) cannot "
                                           r"be read"):
        read_mpijob_hosts({"HYDRA_HOST_FILE": str(tmp_path / "gone")})
    bad = tmp_path / "bad"
    bad.write_text("job-worker-0 slots=zero\n")
    with pytest.raises(ProfileError, match=r"the MPIJob's hostfile .*'job-worker-0:zero' is not HOST\[:SLOTS\]"):
        read_mpijob_hosts({"OMPI_MCA_orte_default_hostfile": str(bad)})


def test_mpijob_profile_is_hydra_over_ssh_to_the_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    monkeypatch.setenv("OMPI_MCA_orte_default_hostfile", str(hostfile))
    profile = profile_for("mpijob", controller_ip="127.0.0.1")
    assert "mpijob" in PROFILES and profile == mpijob_profile(controller_ip="127.0.0.1")
    assert (profile.name, profile.hosts, profile.slurm, profile.single_host) == ("mpijob", (("localhost", 2),),
                                                                                None, False)
    assert profile.mpiexec_args() == ["-launcher", "ssh", "-localhost", "127.0.0.1", "-hosts", "localhost:2"]
    with pytest.raises(ProfileError, match="-np 3 does not fit the hosts' 2 slots"):
        profile.check_size(3)
    with pytest.raises(ProfileError, match="takes the MPIJob's hosts from its hostfile"):
        profile_for("mpijob", hosts="n0:2")


def test_outside_an_mpijob_the_magic_says_so_and_starts_nothing(ip, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in HOSTFILE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    if Path("/etc/mpi/hostfile").exists():
        pytest.skip("this machine has an MPIJob hostfile at /etc/mpi/hostfile")
    before = session_processes()
    with pytest.raises(UsageError, match="--profile mpijob is for a notebook running inside a Kubeflow MPIJob"):
        ip.run_line_magic("taco_cluster", "start --profile mpijob -n 2 --cluster badmpijob")
    assert "badmpijob" not in clusters and session_processes() == before


CELL = """\
import os, socket
t = torch.full((2,), float(taco.rank() + 1))
taco.allreduce(t)
(taco.rank(), taco.node(), socket.gethostname(), t.tolist(), "IPP_CONNECTION_INFO" in os.environ)
"""


@pytest.mark.services
@needs_hosts
@pytest.mark.timeout(300, method="signal")
def test_a_notebook_in_the_launcher_attaches_to_the_hostfiles_nodes(ip, emulated: EmulatedHosts,  # noqa: F811
                                                                    tmp_path: Path, capsys,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{host} slots=2\n" for host in sorted(emulated.nodes.nodes)))  # Open MPI's form
    monkeypatch.setenv("OMPI_MCA_orte_default_hostfile", str(hostfile))
    try:
        began = time.monotonic()
        ip.run_line_magic("taco_cluster", "start --profile mpijob -n 4 --cluster mpijob")
        started = time.monotonic() - began
        cluster = clusters["mpijob"]
        assert cluster.profile.name == "mpijob" and cluster.profile.controller_ip == emulated.nodes.bridge_address
        ranks = ip.run_cell_magic("taco_run", "--profile mpijob -np 4 --gather --cluster mpijob --no-dashboard", CELL)
        assert clusters["mpijob"] is cluster
    finally:
        if "mpijob" in clusters:
            ip.run_line_magic("taco_cluster", "stop --cluster mpijob")
    left = _left_on_nodes(emulated)
    out = capsys.readouterr().out
    with capsys.disabled():
        print(f"\n--profile mpijob over 2 emulated nodes x 2 slots (Open MPI hostfile): start {started:.1f} s")
    assert [(rank, node, host) for rank, node, host, *_ in ranks] == [(0, 0, "n0"), (1, 0, "n0"), (2, 1, "n1"),
                                                                      (3, 1, "n1")]
    assert all(total == [10.0, 10.0] for *_, total, _ in ranks), ranks
    # the engines got the controller's connection info from their environment (through hydra), which they read
    # instead of the controller's file: worker pods need no filesystem shared with the launcher
    assert all(from_env for *_, from_env in ranks), ranks
    assert "4 ranks on n0, n1" in out
    assert left == {}, f"left running on the nodes after stop: {left}"
