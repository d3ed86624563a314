"""``--gpus`` in the plan layer: the check before a start (``exclusive`` refuses, ``auto`` shares) and the one
``[taco]`` line a start prints when ``auto`` shares a node's GPUs. The node's GPUs are a driver directory laid
out like ``/proc/driver/nvidia/gpus``; the one start is a real cluster's, on this machine's (no) GPUs."""

from __future__ import annotations

import io

import pytest

from taco_notebook.cluster.describe import RankInfo
from taco_notebook.comm.group import hardware
from taco_notebook.errors import OptionError
from taco_notebook.plan import clusters as plan_clusters
from taco_notebook.plan.gpus import sharing_line
from taco_notebook.plan.output import RankOutput
from taco_notebook.plan.resolve import gpu_option


@pytest.fixture
def gpus_here(tmp_path, monkeypatch):
    """This machine seen with ``n`` NVIDIA GPUs, and no TACO_GPUS/CUDA_VISIBLE_DEVICES of the caller's."""

    def make(n: int) -> None:
        root = tmp_path / f"gpus{n}"
        for i in range(n):
            (root / f"0000:{i + 0x18:02x}:00.0").mkdir(parents=True)
        root.mkdir(exist_ok=True)
        monkeypatch.setattr(hardware, "_NVIDIA_GPUS", str(root))

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("TACO_GPUS", raising=False)
    return make


def _ranks(per_node: list[tuple[str, int, int]]) -> list[RankInfo]:
    """RankInfos of nodes given as (host, GPUs, ranks)."""
    ranks: list[RankInfo] = []
    for node, (host, gpus, count) in enumerate(per_node):
        ranks += [RankInfo(len(ranks), host, 1000 + len(ranks), local, node, gpus) for local in range(count)]
    return ranks


def test_auto_with_fewer_gpus_than_ranks_is_accepted_and_exclusive_refused(gpus_here):
    gpus_here(1)
    assert gpu_option(None, 4) is None  # not given: the ranks read TACO_GPUS or auto themselves
    assert gpu_option("auto", 4) == "auto" and gpu_option("shared", 4) == "shared"
    assert gpu_option("exclusive", 1) == "exclusive"
    with pytest.raises(OptionError) as info:
        gpu_option("Exclusive", 4)
    for part in ("has 1 GPU but 4 ranks", "--gpus exclusive", "--gpus auto", "--gpus none", "at most 1 rank"):
        assert part in str(info.value), (part, str(info.value))
    with pytest.raises(OptionError, match="auto, exclusive, shared, none, got 'strict'"):
        gpu_option("strict", 4)


def test_exclusive_from_the_environment_is_refused_too(gpus_here, monkeypatch):
    gpus_here(2)
    monkeypatch.setenv("TACO_GPUS", "exclusive")
    with pytest.raises(OptionError, match="has 2 GPUs but 4 ranks"):
        gpu_option(None, 4)
    gpus_here(0)
    assert gpu_option(None, 4) is None  # a CPU box: nothing to refuse


@pytest.mark.parametrize(("mode", "nodes", "expected"), [
    ("auto", [("vm", 1, 4)], "--gpus auto: node vm has 1 GPU for 4 ranks, so the ranks share it."),
    ("auto", [("vm", 0, 4)], None),                   # CPU only: auto means CPU, nothing to say
    ("auto", [("vm", 4, 4)], None),                   # a GPU per rank
    ("auto", [("vm", 8, 2)], None),
    ("shared", [("vm", 1, 4)], None),                 # asked for: nothing to tell
    ("none", [("vm", 1, 4)], None),
    ("auto", [("n0", 8, 8), ("n1", 2, 8), ("n2", 1, 8)], "--gpus auto: 2 nodes (first: n1) have 1 GPU for 8 ranks"),
    ("auto", [("n0", 8, 8), ("n1", 2, 8)], "--gpus auto: node n1 has 2 GPUs for 8 ranks, so the ranks share them."),
])
def test_the_sharing_line_of_a_started_cluster(mode, nodes, expected):
    line = sharing_line(mode, _ranks(nodes))
    if expected is None:
        assert line is None
    else:
        assert line is not None and line.startswith(expected), line
        assert "gloo through host memory" in line and "--gpus exclusive" in line and "--gpus none" in line
        # -np alone gives a GPU per rank only where the cluster is one node
        fewest = min(gpus for _, gpus, count in nodes if 0 < gpus < count)
        advice = f"-np {fewest} (" if len(nodes) == 1 else f"at most {fewest} rank{'s' if fewest > 1 else ''} per node"
        assert advice in line, (advice, line)


@pytest.mark.cluster
@pytest.mark.parametrize("mode", ["auto", "exclusive"])
def test_a_real_start_on_a_node_without_gpus_says_ready_and_nothing_about_sharing(mode):
    """start_cluster (every start of the notebook and of `launch` goes through it) with real MPI ranks: they
    report their node's GPUs (none here), so no sharing line follows 'ready'. The line's text for nodes that
    share is :func:`sharing_line`'s, tested above; no GPU is at hand here to make real ranks report one."""
    out = io.StringIO()
    try:
        cluster = plan_clusters.start_cluster("gpu-none", 2, None, RankOutput(stdout=out), {"TACO_GPUS": mode})
        assert [r.gpus for r in cluster.ranks] == [0, 0]
        assert plan_clusters.cluster_gpu_mode(cluster) == mode
    finally:
        stopped = plan_clusters.clusters.pop("gpu-none", None)
        if stopped is not None:
            stopped.stop()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("[taco] starting cluster 'gpu-none': 2 ranks with "), lines
    assert lines[1].startswith("[taco] cluster 'gpu-none' ready in "), lines
    assert len(lines) == 2, lines
