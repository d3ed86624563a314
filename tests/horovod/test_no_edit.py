"""``--horovod``: a Horovod PyTorch script that imports ``horovod`` and ``horovod.torch`` runs unchanged, from a
cell (``%taco_run --horovod``) and from a shell (``taco-notebook launch --horovod``), and nothing stays shadowed
after it; the names are put back in this process too."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from IPython.core.error import UsageError

import taco_notebook.horovod as face
from taco_notebook.errors import RankFailedError
from taco_notebook.horovod.shadow import HorovodRunError, as_horovod

from ..cli.test_launch import launch
from ..magics.test_magics import rank_lines

# Horovod's example programs' shape: `import horovod` for horovod.run, `import horovod.torch as hvd` for the API
SCRIPT = """\
import argparse
import json
import sys

import torch

import horovod
import horovod.torch as hvd
from horovod.torch.mpi_ops import allreduce_async, synchronize

parser = argparse.ArgumentParser()
parser.add_argument("--num-proc", type=int)
parser.add_argument("--other", help="a framework Horovod has and taco's face has not")


def train(args):
    hvd.init()
    torch.manual_seed(42)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * hvd.size())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=hvd.Compression.fp16)
    torch.manual_seed(hvd.rank())
    losses = []
    for _ in range(20):
        x = torch.randn(16, 4)
        optimizer.zero_grad()
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        loss.backward()
        optimizer.step()
        losses.append(hvd.allreduce(loss.detach(), name="loss").item())
    mean = synchronize(allreduce_async(torch.tensor([float(hvd.rank())]), name="mean"))
    if args.other:
        __import__(args.other)
    print(json.dumps({"size": hvd.size(), "rank": hvd.rank(), "mean": mean.item(), "face": hvd.__name__,
                      "same": horovod.torch is hvd, "falls": losses[-1] < losses[0], "has_run": callable(horovod.run)}))


if __name__ == "__main__":
    args = parser.parse_args()
    if args.num_proc:
        horovod.run(train, args=(args,), np=args.num_proc)
    else:
        train(args)
"""


@pytest.fixture
def hvd_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "hvd_train.py"
    path.write_text(SCRIPT)
    monkeypatch.chdir(tmp_path)
    return path


def reports(out: str) -> dict[int, dict]:
    return {rank: json.loads(lines[-1]) for rank, lines in rank_lines(out).items()}


def test_the_names_are_taco_while_entered_and_put_back_after() -> None:
    sys.modules.pop("horovod", None)
    with as_horovod():
        import horovod
        import horovod.torch as hvd
        from horovod.torch import optimizer

        assert hvd is face and horovod.torch is face and optimizer.DistributedOptimizer is face.DistributedOptimizer
        with pytest.raises(HorovodRunError, match="already runs on every rank.*leave out --num-proc"):
            horovod.run(print, np=2)
        with pytest.raises(ModuleNotFoundError, match=r"'horovod.tensorflow'.*provides horovod and horovod.torch"):
            __import__("horovod.tensorflow")
    assert not any(name == "horovod" or name.startswith("horovod.") for name in sys.modules)
    with pytest.raises(ModuleNotFoundError, match="No module named 'horovod'"):
        __import__("horovod")


@pytest.mark.cluster
def test_a_horovod_script_runs_unchanged_from_a_cell(ip, shared_cluster, hvd_script, capsys):
    ip.run_line_magic("taco_run", f"--quiet --horovod {hvd_script.name}")
    found = reports(capsys.readouterr().out)
    assert sorted(found) == [0, 1, 2, 3], found
    assert all(r == {"size": 4, "rank": rank, "mean": 1.5, "face": "taco_notebook.horovod", "same": True,
                     "falls": True, "has_run": True} for rank, r in found.items()), found
    left = ip.run_cell_magic("taco_run", "--gather", "import sys\n'horovod' in sys.modules")
    assert left == [False] * 4  # nothing shadowed once the script is done
    with pytest.raises(RankFailedError, match="ModuleNotFoundError: No module named 'horovod'"):
        ip.run_line_magic("taco_run", f"--quiet {hvd_script.name}")  # without the option: nothing shadowed
    with pytest.raises(RankFailedError, match="HorovodRunError: horovod.run starts processes of its own"):
        ip.run_line_magic("taco_run", f"--quiet --horovod {hvd_script.name} --num-proc 2")
    with pytest.raises(RankFailedError, match="No module named 'horovod.keras': taco's --horovod provides"):
        ip.run_line_magic("taco_run", f"--quiet --horovod {hvd_script.name} --other horovod.keras")


@pytest.mark.cluster
def test_a_horovod_script_runs_unchanged_from_launch(hvd_script):
    result = launch("-np", "2", "--quiet", "--no-dashboard", "--horovod", hvd_script.name, cwd=hvd_script.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    found = [json.loads(line.split("] ", 1)[1]) for line in result.stdout.splitlines() if line.startswith("[rank ")]
    assert sorted(r["rank"] for r in found) == [0, 1] and all(r["size"] == 2 and r["mean"] == 0.5 for r in found)


def test_a_cell_takes_no_horovod_option(ip):
    with pytest.raises(UsageError, match=r"--horovod runs a Horovod script.*import taco_notebook.horovod as hvd"):
        ip.run_cell_magic("taco_run", "-np 2 --cluster never --horovod", "print('never runs')")
