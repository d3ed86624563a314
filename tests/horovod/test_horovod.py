"""``taco_notebook.horovod`` against Horovod's meaning: rank scripts under real ``mpiexec`` on 2 and 4 ranks (4 as two
emulated nodes, so the 2D allreduce runs underneath), the Horovod-style example programs, and the pure parts.

One ``mpiexec`` per rank count runs both rank scripts (tests/mpi/horovod_api.py, horovod_training.py), which
keeps this module at well under a minute of the suite. A run that overruns is killed whole (tests/support/mpirun.py).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import taco_notebook.horovod as hvd

from ..support.mpirun import mpi_env, run_in_session

ROOT = Path(__file__).parents[2]
SCRIPTS = ROOT / "tests" / "mpi"
EXAMPLES = ROOT / "examples" / "scripts"


def run_ranks(mpiexec: str, n: int, argv: list[str], env: dict[str, str] | None = None,
              timeout: float = 150) -> subprocess.CompletedProcess[str]:
    """``mpiexec -n N python ARGV``; on timeout mpiexec and every process it started are killed before the test
    fails (tests/support/mpirun.py)."""
    return run_in_session([mpiexec, "-n", str(n), sys.executable, *argv], env=mpi_env(env), timeout=timeout)


BOTH_SCRIPTS = ("import runpy, sys; "
                f"runpy.run_path({str(SCRIPTS / 'horovod_api.py')!r}, run_name='__main__'); "
                f"runpy.run_path({str(SCRIPTS / 'horovod_training.py')!r}, run_name='__main__')")


@pytest.mark.parametrize("n, env", [(2, {}), (4, {"LIGHT_INTRA_SIZE": "2"})], ids=["2-ranks", "4-ranks-2-nodes"])
def test_every_call_and_the_optimizer_under_mpiexec(mpiexec: str, n: int, env: dict[str, str]) -> None:
    """Values, in/out of place, dtypes, 0-d, uneven allgather, handles, root_rank, objects, optimizer state,
    alltoall, errors before init; DistributedOptimizer (passes, ops, predivide, every compression) and
    SyncBatchNorm against a single BatchNorm over the concatenated batch."""
    result = run_ranks(mpiexec, n, ["-c", BOTH_SCRIPTS], env)
    assert result.returncode == 0, result.stdout + result.stderr
    reports = re.findall(r"OK (\d+) (\d+) checks", result.stdout)
    ranks = sorted(int(rank) for rank, _ in reports)
    assert ranks == sorted(list(range(n)) * 2), result.stdout  # both scripts, every rank
    assert all(int(count) > 40 for _, count in reports), reports


def _example(name: str, *args: str) -> list[str]:
    return [str(EXAMPLES / name), *args]


@pytest.mark.parametrize("n", [2, 4])
def test_horovod_mnist_program_runs_and_learns(mpiexec: str, n: int) -> None:
    """The MNIST-shaped Horovod program (only its import line is taco's) trains under mpiexec, fp16 allreduce."""
    result = run_ranks(mpiexec, n, _example("hvd_mnist.py", "--epochs", "2", "--train-size", "512", "--test-size",
                                            "128", "--batch-size", "32", "--log-interval", "100",
                                            "--lr", "0.05", "--fp16-allreduce", "--no-cuda"))
    assert result.returncode == 0, result.stdout + result.stderr
    losses = [float(v) for v in re.findall(r"Epoch \d+: average train loss ([\d.]+)", result.stdout)]
    assert len(losses) == 2 and losses[1] < losses[0], result.stdout
    assert len(re.findall(r"Test set: Average loss: [\d.]+, Accuracy: [\d.]+%", result.stdout)) == 2, result.stdout


def test_horovod_synthetic_benchmark_runs(mpiexec: str) -> None:
    result = run_ranks(mpiexec, 4, _example("hvd_synthetic_benchmark.py", "--model", "small_cnn", "--image-size",
                                            "16", "--batch-size", "4", "--num-warmup-batches", "1",
                                            "--num-batches-per-iter", "2", "--num-iters", "2", "--no-cuda"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Number of CPUs: 4" in result.stdout, result.stdout
    total = re.search(r"Total img/sec on 4 CPU\(s\): ([\d.]+)", result.stdout)
    assert total and float(total.group(1)) > 0, result.stdout


def test_use_adasum_fails_naming_adasum(mpiexec: str) -> None:
    result = run_ranks(mpiexec, 1, _example("hvd_synthetic_benchmark.py", "--use-adasum", "--model", "small_cnn",
                                            "--image-size", "16", "--no-cuda"), timeout=90)
    assert result.returncode != 0
    assert "hvd.Adasum is not implemented by taco_notebook.horovod" in result.stdout + result.stderr


def test_calls_before_init_raise_horovods_value_error() -> None:
    assert not hvd.is_initialized()
    for call in (hvd.rank, hvd.size, hvd.local_rank, hvd.cross_size, lambda: hvd.allreduce(torch.ones(2)),
                 lambda: hvd.allreduce_async_(torch.ones(2)), lambda: hvd.broadcast(torch.ones(1), 0),
                 lambda: hvd.broadcast_parameters({}, 0), lambda: hvd.allgather_object(1), hvd.barrier,
                 lambda: hvd.SyncBatchNorm(3).train()(torch.ones(4, 3))):
        with pytest.raises(ValueError, match=r"Horovod has not been initialized; use hvd\.init\(\)\."):
            call()


def test_reduce_ops_and_average_keyword() -> None:
    from taco_notebook.horovod.basics import reduce_op

    assert (int(hvd.Average), int(hvd.Sum), int(hvd.Adasum), int(hvd.Min), int(hvd.Max), int(hvd.Product)) == \
        (0, 1, 2, 3, 4, 5)  # Horovod's numbering, for code that stores them
    assert reduce_op(None) is hvd.Average and reduce_op(hvd.Max) is hvd.Max
    with pytest.warns(DeprecationWarning):
        assert reduce_op(None, average=False) is hvd.Sum
    with pytest.raises(ValueError, match="supersedes average"):
        reduce_op(hvd.Sum, average=True)
    with pytest.raises(NotImplementedError, match="hvd.Adasum"):
        reduce_op(hvd.Adasum)
    with pytest.raises(ValueError, match="op must be one of"):
        reduce_op(17)


def test_compression_objects_name_comm_compressors() -> None:
    from taco_notebook.horovod.compression import spec_of

    assert [c.spec.name for c in (hvd.Compression.none, hvd.Compression.fp16, hvd.Compression.bf16)] == \
        ["none", "fp16", "bf16"]
    assert hvd.Compression.topk(0.05, threshold=0).spec.name == "topk:0.05:threshold=0"
    assert hvd.Compression.powersgd(2, warmup=0).spec.name.startswith("powersgd:2")
    assert spec_of(hvd.Compression.fp16).name == "fp16" and spec_of("TopK:0.01") == spec_of(hvd.Compression.topk)
    with pytest.raises(TypeError, match="takes no arguments"):
        hvd.Compression.fp16(2)
    with pytest.raises(TypeError, match="compression must be"):
        spec_of(42)
    # compress/decompress as Horovod's objects, through the comm compressor
    tensor = torch.linspace(-1, 1, 10)
    payload, ctx = hvd.Compression.fp16.compress(tensor)
    assert payload.dtype == torch.float16
    back = hvd.Compression.fp16.decompress(payload, ctx)
    assert back.dtype == torch.float32 and torch.allclose(back, tensor, atol=1e-3)
    assert isinstance(hvd.Compression.bf16, hvd.Compressor)


def test_built_flags_need_no_init() -> None:
    assert hvd.gloo_built() and hvd.mpi_built() and not hvd.mpi_enabled() and not hvd.ddl_built()
    assert hvd.nccl_built() == 0 or torch.cuda.is_available()
    assert hvd.cuda_built() == (torch.version.cuda is not None)
    assert not hvd.ccl_built() and not hvd.sycl_built()  # Horovod's tests ask both before using process sets



def test_imports_without_ipython_and_only_comm() -> None:
    """Importable on a rank with no IPython/ipyparallel; it builds on comm/ only (no cluster, magics, widgets)."""
    code = ("import sys, taco_notebook.horovod; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'IPython', 'ipyparallel', 'ipywidgets'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
    package = ROOT / "taco_notebook" / "horovod"
    imported: set[str] = set()
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 2:
                imported.add((node.module or "").split(".")[0])
    assert imported == {"comm"}, imported
