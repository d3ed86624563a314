"""GPU placement, the per-device backend string, the MPI-mismatch check and ``--gpus``: their pure parts on
any machine, and CPU ranks under the new backend selection under a real ``mpiexec``.

This machine has no GPU: the node's GPUs are read from a driver directory laid out like
``/proc/driver/nvidia/gpus`` (one directory per GPU, an ``information`` file with a ``Model:`` line), so the
decision is tested over 0, 1, fewer and more GPUs than ranks. Nothing here initialises CUDA.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from IPython.core.error import UsageError

from taco_notebook.comm.group import hardware, placement
from taco_notebook.comm.group.mpicheck import launcher_size, mismatch_message
from taco_notebook.comm.group.placement import PlacementError, backend_for, check_gpus, decide, launcher_local

from ..support.mpirun import run_in_session

SCRIPTS = Path(__file__).parents[1] / "mpi"


@pytest.fixture
def node_with(tmp_path, monkeypatch):
    """Make this process see a node with ``n`` NVIDIA GPUs (a driver directory, as /proc lays it out)."""

    def make(n: int, model: str = "NVIDIA H100 80GB HBM3") -> None:
        root = tmp_path / f"gpus{n}"
        for i in range(n):
            bus = root / f"0000:{i + 0x18:02x}:00.0"
            bus.mkdir(parents=True)
            (bus / "information").write_text(f"Model: \t\t {model} #{i}\nIRQ:   \t\t 42\n")
        root.mkdir(exist_ok=True)
        monkeypatch.setattr(hardware, "_NVIDIA_GPUS", str(root))
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        monkeypatch.delenv("TACO_GPUS", raising=False)

    return make


@pytest.mark.parametrize(("mode", "local_rank", "local_size", "gpus", "device", "backend"), [
    ("auto", 0, 1, 0, "cpu", "gloo"),                    # CPU node
    ("auto", 3, 4, 0, "cpu", "gloo"),
    ("auto", 0, 1, 1, "cuda:0", "cpu:gloo,cuda:nccl"),   # one GPU, one rank
    ("auto", 1, 2, 8, "cuda:1", "cpu:gloo,cuda:nccl"),   # more GPUs than ranks
    ("auto", 3, 4, 4, "cuda:3", "cpu:gloo,cuda:nccl"),   # as many
    ("shared", 1, 2, 1, "cuda:0", "cpu:gloo,cuda:gloo"),  # fewer GPUs than ranks, shared
    ("shared", 3, 4, 2, "cuda:1", "cpu:gloo,cuda:gloo"),
    ("shared", 0, 2, 0, "cpu", "gloo"),
    ("none", 0, 2, 8, "cpu", "gloo"),
    ("auto", 3, 4, 1, "cuda:0", "cpu:gloo,cuda:gloo"),   # fewer GPUs than ranks: auto shares, over gloo
    ("auto", 5, 8, 2, "cuda:1", "cpu:gloo,cuda:gloo"),
    ("exclusive", 1, 2, 4, "cuda:1", "cpu:gloo,cuda:nccl"),  # enough GPUs: exclusive is auto
    ("exclusive", 1, 2, 0, "cpu", "gloo"),                # a CPU node is no error
])
def test_placement_decision_table(mode, local_rank, local_size, gpus, device, backend):
    placed = decide(mode, local_rank, local_size, gpus)
    assert (placed.device, placed.backend) == (device, backend)
    assert placed.hide_gpus == (mode == "none")


@pytest.mark.parametrize("gpus", [0, 1, 2, 4])
@pytest.mark.parametrize("local_size", [1, 2, 4, 8])
def test_auto_gives_every_rank_a_gpu_of_its_own_or_shares_them_round_robin(gpus, local_size):
    """Never an error: CPU without GPUs, a GPU each over NCCL where there are enough, else shared over gloo."""
    placed = [decide("auto", rank, local_size, gpus) for rank in range(local_size)]
    if gpus == 0:
        assert {(p.device, p.backend) for p in placed} == {("cpu", "gloo")}
    elif gpus >= local_size:
        assert [p.gpu for p in placed] == list(range(local_size))
        assert {p.backend for p in placed} == {"cpu:gloo,cuda:nccl"}
    else:
        assert [p.gpu for p in placed] == [rank % gpus for rank in range(local_size)]
        assert {p.backend for p in placed} == {"cpu:gloo,cuda:gloo"}  # NCCL refuses two ranks on one GPU
    assert placement.shares_gpus("auto", gpus, local_size) == (0 < gpus < local_size)
    assert all(p.mode == "auto" and not p.hide_gpus for p in placed)


@pytest.mark.parametrize(("gpus", "local_size"), [(1, 2), (1, 4), (2, 4), (4, 8)])
def test_exclusive_with_fewer_gpus_than_ranks_names_node_count_ranks_and_the_ways_out(gpus, local_size):
    with pytest.raises(PlacementError) as info:
        decide("exclusive", 0, local_size, gpus, node="gpu-node-7")
    text = str(info.value)
    for part in ("gpu-node-7", f"{gpus} GPU", f"{local_size} ranks", "--gpus exclusive", "--gpus auto",
                 "--gpus none", f"at most {gpus} rank"):
        assert part in text, (part, text)


def test_the_sharing_notice_names_what_it_costs_and_every_alternative():
    text = placement.sharing_notice("vm", 1, 4)
    assert "\n" not in text, text  # one [taco] line
    for part in ("node vm has 1 GPU for 4 ranks", "share it", "NCCL cannot run two ranks on one GPU",
                 "allreduce runs in its memory (CUDA IPC)", "gloo through host memory", "-np 1", "--gpus none",
                 "--gpus exclusive"):
        assert part in text, (part, text)
    several = placement.sharing_notice("n0", 2, 8, nodes=3, cluster_nodes=4)
    for part in ("3 nodes (first: n0) have 2 GPUs for 8 ranks", "share them", "at most 2 ranks per node",
                 "CUDA tensors go over gloo through host memory", "--gpus none", "--gpus exclusive"):
        assert part in several, (part, several)
    assert "CUDA IPC" not in several  # ranks of several nodes, or on several GPUs, reduce over gloo


def test_default_backend_follows_the_placement_made(monkeypatch):
    """A rebuilt group (elastic) takes the backend the placement chose: gloo where auto shares a GPU."""
    from taco_notebook.comm.group import bootstrap

    monkeypatch.delenv("TACO_GPUS", raising=False)
    placement._reset_for_tests()
    try:
        placement._current = decide("auto", 1, 2, 1)
        assert bootstrap.default_backend() == "cpu:gloo,cuda:gloo"
    finally:
        placement._reset_for_tests()


def test_backend_string_per_device_type():
    assert backend_for("auto", cuda=True) == "cpu:gloo,cuda:nccl"
    assert backend_for("shared", cuda=True) == "cpu:gloo,cuda:gloo"
    assert backend_for("none", cuda=True) == "gloo"
    assert {backend_for(m, cuda=False) for m in ("auto", "shared", "none")} == {"gloo"}


def test_mode_checked_with_the_choices(monkeypatch):
    monkeypatch.delenv("TACO_GPUS", raising=False)
    assert check_gpus(None) == "auto" and check_gpus(" Shared ") == "shared"
    assert check_gpus("EXCLUSIVE") == "exclusive"
    monkeypatch.setenv("TACO_GPUS", "none")
    assert check_gpus(None) == "none"
    monkeypatch.setenv("TACO_GPUS", "all")
    with pytest.raises(ValueError, match=r"auto, exclusive, shared, none, got 'all' \(from TACO_GPUS\)"):
        check_gpus(None)
    with pytest.raises(ValueError, match="--gpus must be one of auto, exclusive, shared, none, got 'many'"):
        check_gpus("many")


@pytest.mark.parametrize(("env", "expected"), [
    ({"MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"}, (1, 4)),
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "3"}, (2, 3)),
    ({"SLURM_LOCALID": "1", "SLURM_TASKS_PER_NODE": "4(x2),3", "SLURM_NODEID": "2"}, (1, 3)),
    ({"SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_NODEID": "1"}, (0, 4)),
    ({}, None),
])
def test_local_rank_from_each_launcher(env, expected):
    assert launcher_local(env) == expected


def test_visible_gpus_and_names_follow_cuda_visible_devices(node_with, monkeypatch):
    node_with(0)
    assert hardware.visible_gpus() == 0 and hardware.gpu_names() == []
    node_with(4)
    assert hardware.visible_gpus() == 4
    assert hardware.gpu_names()[0] == "NVIDIA H100 80GB HBM3 #0"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert hardware.visible_gpus() == 2
    assert hardware.gpu_names() == ["NVIDIA H100 80GB HBM3 #2", "NVIDIA H100 80GB HBM3 #0"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,-1,3")  # CUDA stops at the first invalid entry
    assert hardware.visible_gpus() == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert hardware.visible_gpus() == 0 and hardware.gpu_names() == []
    # the decision then sees what CUDA_VISIBLE_DEVICES leaves: 1 GPU for 2 ranks is too few for exclusive
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(PlacementError, match="has 1 GPU but 2 ranks"):
        decide("exclusive", 0, 2, hardware.visible_gpus())


def test_import_time_placement_defers_a_too_few_gpus_error_to_init(node_with, monkeypatch):
    """Under a launcher, import decides at once; too few GPUs for exclusive is raised by resolve() (taco.init),
    not import."""
    node_with(1)
    monkeypatch.setenv("TACO_GPUS", "exclusive")
    monkeypatch.setenv("MPI_LOCALRANKID", "1")
    monkeypatch.setenv("MPI_LOCALNRANKS", "2")
    placement._reset_for_tests()
    try:
        assert placement.apply_from_env() is None
        with pytest.raises(PlacementError, match="has 1 GPU but 2 ranks"):
            placement.resolve(1, 2)
    finally:
        placement._reset_for_tests()


def test_launcher_size_and_the_mismatch_message():
    assert launcher_size({"PMI_SIZE": "4"}) == (4, "PMI_SIZE", "mpich/hydra mpiexec (PMI)")
    assert launcher_size({"OMPI_COMM_WORLD_SIZE": "2"})[1] == "OMPI_COMM_WORLD_SIZE"
    assert launcher_size({"SLURM_NTASKS": "8", "SLURM_STEP_ID": "0"}) is None  # a batch script, not srun
    assert launcher_size({"SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "4"})[:2] == (4, "SLURM_STEP_NUM_TASKS")
    assert launcher_size({}) is None
    text = mismatch_message(1, 2, "OMPI_COMM_WORLD_SIZE", "Open MPI mpiexec", "MPICH Version: 5.0.2\x00\nMore")
    for part in ("started 2 ranks", "has 1 rank", "'MPICH Version: 5.0.2'", "MPI4PY_MPIABI=openmpi",
                 "libmpi.so.40", "LD_LIBRARY_PATH"):
        assert part in text, (part, text)


def test_gpus_option_refused_before_anything_starts(ip, node_with):
    from taco_notebook.cluster.session import clusters

    before = set(clusters)
    with pytest.raises(UsageError, match="--gpus must be one of auto, exclusive, shared, none, got 'several'"):
        ip.run_cell_magic("taco_run", "-np 2 --gpus several --cluster gpu-bad", "print(1)")
    node_with(1)
    with pytest.raises(UsageError) as info:
        ip.run_cell_magic("taco_run", "-np 2 --gpus exclusive --cluster gpu-few", "print(1)")
    assert "has 1 GPU but 2 ranks" in str(info.value) and "--gpus auto" in str(info.value)
    with pytest.raises(UsageError, match="has 1 GPU but 3 ranks"):
        ip.run_line_magic("taco_cluster", "start -n 3 --gpus exclusive --cluster gpu-few")
    assert set(clusters) == before  # nothing started (the autouse fixture also checks for processes)


def test_cpu_ranks_under_the_new_backend_selection(mpiexec):
    """Real ranks: auto on a CPU node and none both give gloo and the CPU; none hides every GPU."""
    for mode in ("auto", "none"):
        env = {**os.environ, "TACO_GPUS": mode}
        result = run_in_session([mpiexec, "-n", "2", sys.executable, str(SCRIPTS / "placement.py")], env=env,
                                timeout=180)
        assert result.returncode == 0, result.stdout + result.stderr
        # the ranks' lines can interleave in mpiexec's output: match them anywhere
        found = sorted(re.findall(r"OK (\d+) (\w+) (\w+) (gloo|cpu:gloo,cuda:\w+)", result.stdout))
        assert found == [("0", mode, "cpu", "gloo"), ("1", mode, "cpu", "gloo")], result.stdout


@pytest.mark.mpi
def test_taco_run_gpus_none_reaches_every_rank_with_mpi4py_on_mpiexecs_mpi(ip):
    """A real cluster: --gpus none hides the GPUs on every rank, and the engines got MPIInfo.environment."""
    from taco_notebook.cluster.session import clusters

    cell = ("import os\n"
            "assert os.environ['CUDA_VISIBLE_DEVICES'] == '' and os.environ['TACO_GPUS'] == 'none'\n"
            "(str(taco.device()), os.environ['MPI4PY_MPIABI'], taco.metrics.snapshot()['gpu'])")
    try:
        values = ip.run_cell_magic("taco_run", "-np 2 --gpus none --cluster gpu-none --quiet --no-dashboard --gather",
                                   cell)
        assert list(values) == [("cpu", "mpich", None)] * 2, values
        cluster = clusters["gpu-none"]
        assert cluster.env["TACO_GPUS"] == "none"
        assert [r.gpu_names for r in cluster.ranks] == [[], []] and cluster.model()["gpus"] == 0
    finally:
        if "gpu-none" in clusters:
            clusters.pop("gpu-none").stop()


def test_importing_the_api_outside_a_launched_rank_leaves_the_gpus_alone():
    """The notebook's kernel imports taco_notebook.comm too: only ranks (or init()) may hide or pin GPUs."""
    env = {k: v for k, v in os.environ.items() if k not in ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK",
                                                            "SLURM_LOCALID", "CUDA_VISIBLE_DEVICES")}
    env["TACO_GPUS"] = "none"
    code = "import os, taco_notebook.comm as taco; print(repr(os.environ.get('CUDA_VISIBLE_DEVICES')))"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "None", result.stdout + result.stderr
