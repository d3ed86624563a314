"""GPU checks of issues 9 and 24, as markdown tables: run unchanged on a GPU machine; elsewhere it says it skipped.

    python benchmarks/gpu_check.py                      # every section; exits 1 if a check failed
    python benchmarks/gpu_check.py --sections overhead  # one section
    python benchmarks/gpu_check.py --device cpu --sections collectives training   # self-test on CPU

Sections:

* ``collectives``: exact allreduce (integer-valued floats, so any error shows) of CUDA tensors on 1 rank over
  NCCL (``--gpus auto``) and on 2 ranks sharing the GPU over gloo (``--gpus shared``), flat and 2d (4 ranks as
  2 emulated nodes); CPU and CUDA tensors in the same process group; broadcast, max, barrier.
* ``training``: ``DistributedOptimizer`` and the DDP hook with every compression on CUDA parameters, 2 ranks
  with different data; the replicas must end identical.
* ``placement``: ``--gpus exclusive`` with more ranks than GPUs must fail at the first cell with the clear
  message; ``--gpus auto`` with as many ranks must share the GPUs over gloo, exactly.
* ``notebooks``: every example notebook executed (nbclient) with CUDA visible and the default ``--gpus auto``.
* ``overhead``: ms per step, 1 rank, 25.2M-parameter MLP (2048-4096-4096-10), batch 256: plain SGD, DDP,
  DDP + torch's fp16 hook, DDP + taco's fp16 hook, taco with every compression; and for each path the host
  synchronisations per step (``torch.cuda.set_sync_debug_mode("warn")``, the warnings counted; goal 0).
  A second table times each compressor's own kernels on a 25.2M-element gradient (what a step costs once
  there are ranks to talk to; with one rank taco reduces nothing), with their syncs.
* ``synthetic``: Horovod's ``pytorch_synthetic_benchmark.py`` shape, 1 rank: ResNet-50 (torchvision) or, without
  torchvision, a plain-torch conv net of 24.5M parameters; batch 32 of 224x224 images, img/s of plain torch, DDP
  and taco's DistributedOptimizer (none, fp16, topk:0.01, powersgd:4), and the same through
  ``taco_notebook.horovod`` (``hvd.DistributedOptimizer``, none and ``hvd.Compression.fp16``), with syncs per step.

``overhead`` and ``synthetic`` need CUDA; with ``--device cpu`` they run a tiny model for a few steps (a
self-test of the script, no figure to read).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("collectives", "training", "placement", "notebooks", "overhead", "synthetic")
COMPRESSIONS = (None, "fp16", "bf16", "topk:0.01")
# every compression timed in ``overhead`` (powersgd compresses from the first step: warmup=0)
TIMED_COMPRESSIONS = ("none", "fp16", "bf16", "topk:0.01", "powersgd:4:warmup=0")
RESULT = "GPUCHECK "


def _results(text: str) -> list[Any]:
    """Every rank's result in ``text``: mpiexec may put two ranks' lines on one line, so find each marker."""
    decoder, found = json.JSONDecoder(), []
    start = text.find(RESULT)
    while start != -1:
        value, end = decoder.raw_decode(text, start + len(RESULT))
        found.append(value)
        start = text.find(RESULT, end)
    return found


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: run the same checks on CPU tensors (a self-test of this script)")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per overhead/synthetic variant")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ---- rank side ----------------------------------------------------------------------------------------------
def _emit(payload: dict[str, Any]) -> None:
    print(RESULT + json.dumps(payload), flush=True)


def worker_collectives(device_kind: str) -> None:
    import torch

    import taco_notebook.comm as taco

    taco.init()
    r, n = taco.rank(), taco.size()
    device = taco.device() if device_kind == "cuda" else torch.device("cpu")
    rows = []
    for algorithm in ("flat", "2d"):
        if algorithm == "2d" and taco.num_nodes() < 2:
            continue
        for name, dev in (("cuda" if device.type == "cuda" else "cpu(self-test)", device), ("cpu", "cpu")):
            t = (torch.arange(1 << 20, dtype=torch.float32, device=dev) % 97) * (r + 1)
            taco.allreduce(t, algorithm=algorithm)
            expected = (torch.arange(1 << 20, dtype=torch.float32, device=dev) % 97) * (n * (n + 1) // 2)
            rows.append({"check": f"allreduce {algorithm} {name}", "exact": bool(torch.equal(t, expected))})
    b = torch.full((7,), float(r), device=device)
    taco.broadcast(b, root=n - 1)
    m = torch.tensor([float(r)], device=device)
    taco.allreduce(m, op="max")
    taco.barrier()
    rows.append({"check": f"broadcast+max on {device.type}",
                 "exact": bool(b.eq(n - 1).all().item() and m.item() == n - 1)})
    _emit({"rank": r, "size": n, "device": str(device), "rows": rows,
           "backend": __import__("taco_notebook.comm.group.bootstrap", fromlist=["state"]).state.backend})
    _close()


def _replicas_identical(params: list[Any]) -> bool:
    import torch

    import taco_notebook.comm as taco

    flat = torch.cat([p.detach().reshape(-1) for p in params])
    reference = flat.clone()
    taco.broadcast(reference, root=0)
    return bool(torch.equal(flat, reference))


def worker_training(device_kind: str) -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import taco_notebook.comm as taco
    from taco_notebook.comm.training import hooks
    from taco_notebook.comm.training.optimizer import DistributedOptimizer

    taco.init()
    r = taco.rank()
    device = taco.device() if device_kind == "cuda" else torch.device("cpu")
    gen = torch.Generator().manual_seed(100 + r)
    data = [(torch.randn(64, 256, generator=gen).to(device), torch.randint(0, 10, (64,), generator=gen).to(device))
            for _ in range(6)]
    rows = []
    for kind in ("optimizer", "ddp-hook"):
        for compression in COMPRESSIONS:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)).to(device)
            net: Any = model
            opt: Any
            if kind == "optimizer":
                opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(), compression=compression)
            else:
                net = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
                net.register_comm_hook(hooks.TacoHookState(compression=compression), hooks.allreduce_hook)
                opt = torch.optim.SGD(net.parameters(), lr=0.1)
            for x, y in data:
                opt.zero_grad()
                F.cross_entropy(net(x), y).backward()
                opt.step()
            on = {p.device.type for p in model.parameters()}
            rows.append({"check": f"{kind} {compression or 'none'} on {'/'.join(sorted(on))}",
                         "exact": _replicas_identical(list(model.parameters()))})
            if kind == "optimizer":
                opt.remove_hooks()
            del net, opt, model
    _emit({"rank": r, "rows": rows})
    _close()


def _close() -> None:
    """Free DDP's reducers, then the process group, before the interpreter's teardown: left to C++
    destructors at exit, gloo's threads can abort the process ("terminate called without an active exception")."""
    import gc

    import taco_notebook.comm as taco

    gc.collect()
    taco.barrier()
    taco.shutdown()


class SyncCounter:
    """Counts the host synchronisations CUDA reports while it is entered: ``torch.cuda.set_sync_debug_mode("warn")``
    makes every synchronising call (``.item()``, ``nonzero``, a blocking copy, a stream sync) warn, and the
    warnings are caught, from every thread (the comm thread's too), each one counted. On CPU it counts nothing
    (``count`` stays None)."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self.count: int | None = None

    def __enter__(self) -> SyncCounter:
        import warnings

        import torch

        if self.device.type != "cuda":
            return self
        self._catch = warnings.catch_warnings(record=True)
        self._seen = self._catch.__enter__()
        warnings.simplefilter("always")  # the default filter shows a warning once per place: count them all
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        import torch

        if self.device.type != "cuda":
            return
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        self._catch.__exit__(None, None, None)
        self.count = sum("synchroniz" in str(w.message) for w in self._seen)


def _timed_steps(step: Any, device: Any, warmup: int, steps: int, counted: int = 3) -> tuple[float, float | None]:
    """ms per ``step()`` over ``steps`` after ``warmup``, then host syncs per step over ``counted`` more."""
    import torch

    def wait() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()  # outside the timed loop only

    for _ in range(warmup):
        step()
    wait()
    began = time.perf_counter()
    for _ in range(steps):
        step()
    wait()
    ms = (time.perf_counter() - began) / steps * 1000
    if not counted:
        return ms, None
    with SyncCounter(device) as syncs:
        for _ in range(counted):
            step()
    return ms, None if syncs.count is None else syncs.count / counted


def _train_step(net: Any, opt: Any, x: Any, y: Any) -> None:
    import torch.nn.functional as F

    opt.zero_grad()
    F.cross_entropy(net(x), y).backward()
    opt.step()


def _wrap(variant: str, model: Any, device: Any, lr: float = 0.01) -> tuple[Any, Any]:
    """(the module to call, the optimizer to step) for ``variant``: plain, DDP[+hook], or taco [COMPRESSION]."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from taco_notebook.comm.training import hooks
    from taco_notebook.comm.training.optimizer import DistributedOptimizer

    net: Any = model
    if variant.startswith("DDP"):
        net = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        if "torch fp16" in variant:
            net.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif "taco fp16" in variant:
            net.register_comm_hook(hooks.TacoHookState(compression="fp16"), hooks.allreduce_hook)
    opt: Any = torch.optim.SGD(net.parameters(), lr=lr)
    if variant.startswith("horovod"):  # what a Horovod script gets from `import taco_notebook.horovod as hvd`
        import taco_notebook.horovod as hvd

        hvd.init()
        compression = hvd.Compression.fp16 if "fp16" in variant else hvd.Compression.none
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression)
    elif variant.startswith("taco"):
        opt = DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=variant.split(" ")[1] if " " in variant else None)
    return net, opt


def _release(opt: Any) -> None:
    if hasattr(opt, "remove_hooks"):
        opt.remove_hooks()


def _interleaved(steps_of: dict[str, Any], device: Any, warmup: int, steps: int, rounds: int = 5
                 ) -> tuple[dict[str, float], dict[str, float | None]]:
    """ms per step of each variant in ``steps_of`` (name -> a function doing one step) and its host syncs per
    step. The variants are timed in turn, ``rounds`` times ``steps // rounds`` steps each, and each one's median
    round is kept: a change of the GPU's clocks or of the machine's load then weighs on every variant alike (one
    variant after the other, the first ones were seen 5-10% off on an H100)."""
    for step in steps_of.values():
        _timed_steps(step, device, warmup, 1, counted=0)
    per_round = max(1, steps // rounds)
    times: dict[str, list[float]] = {name: [] for name in steps_of}
    for _ in range(rounds):
        for name, step in steps_of.items():
            times[name].append(_timed_steps(step, device, 0, per_round, counted=0)[0])
    syncs = {name: _timed_steps(step, device, 0, 1)[1] for name, step in steps_of.items()}
    return {name: statistics.median(t) for name, t in times.items()}, syncs


def worker_overhead(steps: int, device_kind: str) -> None:
    import torch

    import taco_notebook.comm as taco

    taco.init()
    device = taco.device() if device_kind == "cuda" else torch.device("cpu")
    wide, batch = (4096, 256) if device.type == "cuda" else (64, 8)  # cpu: a self-test, not a measurement
    x = torch.randn(batch, wide // 2, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    variants = ("plain SGD", "DDP", "DDP + torch fp16 hook", "DDP + taco fp16 hook",
                *(f"taco {c}" if c != "none" else "taco" for c in TIMED_COMPRESSIONS))
    ms, syncs, params = timed_mlp_steps(variants, wide, x, y, device, 10, steps)
    kernels = _compressor_kernels(params, device, steps)
    _emit({"rank": taco.rank(), "params": params, "ms": ms, "syncs": syncs, "kernels": kernels,
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (self-test)"})
    _close()


def timed_mlp_steps(variants: Sequence[str], wide: int, x: Any, y: Any, device: Any, warmup: int, steps: int
                    ) -> tuple[dict[str, float], dict[str, float | None], int]:
    """ms per training step and host syncs per step of each variant (:func:`_wrap`), each with its own MLP
    (wide/2-wide-wide-10) from the same seed, timed in turns (:func:`_interleaved`); and the MLP's parameters."""
    import torch

    wrapped = {}
    for variant in variants:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(wide // 2, wide), torch.nn.ReLU(), torch.nn.Linear(wide, wide),
                                    torch.nn.ReLU(), torch.nn.Linear(wide, 10)).to(device)
        wrapped[variant] = _wrap(variant, model, device)
    ms, syncs = _interleaved({v: partial(_train_step, net, opt, x, y) for v, (net, opt) in wrapped.items()},
                             device, warmup, steps)
    for _, opt in wrapped.values():
        _release(opt)
    return ms, syncs, sum(p.numel() for p in model.parameters())


def _compressor_kernels(numel: int, device: Any, steps: int) -> dict[str, Any]:
    """Per compression: ms of ``compress`` and of ``decompress`` of a ``numel``-element float32 gradient (the
    work a rank does per step once there are peers), and the host syncs of one compress + decompress."""
    import torch

    from taco_notebook.comm.compression.compressors import build
    from taco_notebook.comm.compression.spec import CompressionSpec

    grad = torch.randn(numel, device=device)
    square = int(numel ** 0.5)  # PowerSGD compresses matrices: a (square x square) view of the gradient
    found: dict[str, Any] = {}
    for spec in TIMED_COMPRESSIONS:
        compressor = build(CompressionSpec.parse(spec))
        tensor = grad[: square * square].view(square, square) if spec.startswith("powersgd") else grad
        out: dict[str, Any] = {}
        repeats = max(3, steps // 5)
        out["compress_ms"], out["compress_syncs"] = _timed_steps(
            partial(compressor.compress, tensor, key="g"), device, 3, repeats, counted=1)
        payload, ctx = compressor.compress(tensor, key="g")
        out["decompress_ms"], out["decompress_syncs"] = _timed_steps(
            partial(compressor.decompress, payload, ctx), device, 3, repeats, counted=1)
        out["wire_mb"] = compressor.wire_bytes(payload) / 1e6
        found[spec] = out
    return found


def synthetic_model(torchvision_ok: bool, tiny: bool) -> tuple[Any, str]:
    """ResNet-50 from torchvision when importable, else a plain-torch conv net of 24.5M parameters (a conv
    stem of 1.55M and an MLP head of 23.0M: about ResNet-50's 25.6M, with fewer, larger tensors)."""
    from torch import nn

    if tiny:
        return nn.Sequential(nn.Conv2d(3, 8, 3, stride=4), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                             nn.Linear(32, 10)), "tiny conv net (self-test)"
    if torchvision_ok:
        import torchvision

        return torchvision.models.resnet50(), "ResNet-50 (torchvision)"
    layers: list[nn.Module] = []
    for cin, cout in ((3, 64), (64, 128), (128, 256), (256, 512)):
        layers += [nn.Conv2d(cin, cout, 3, stride=2, padding=1), nn.BatchNorm2d(cout), nn.ReLU()]
    head = [nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(8192, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
            nn.Linear(2048, 1000)]
    return nn.Sequential(*layers, *head), "plain-torch conv net (no torchvision)"


def worker_synthetic(steps: int, device_kind: str) -> None:
    """Horovod's synthetic benchmark, one rank: SGD(lr=0.01) on random 224x224 images and random labels, img/s
    over ``steps`` batches after 10 warm-up batches (Horovod: 10 warm-up, then 10 iterations of 10 batches)."""
    import importlib.util

    import torch

    import taco_notebook.comm as taco

    taco.init()
    device = taco.device() if device_kind == "cuda" else torch.device("cpu")
    tiny = device.type != "cuda"
    batch, side = (32, 224) if not tiny else (4, 32)
    data = torch.rand(batch, 3, side, side, device=device)
    target = torch.randint(0, 10 if tiny else 1000, (batch,), device=device)
    torchvision_ok = importlib.util.find_spec("torchvision") is not None
    wrapped = {}
    for variant in ("plain torch", "DDP", "taco", "taco fp16", "taco topk:0.01", "taco powersgd:4:warmup=0",
                    "horovod", "horovod fp16"):
        torch.manual_seed(0)
        model, name = synthetic_model(torchvision_ok, tiny)
        wrapped[variant] = _wrap(variant, model.to(device), device)
    ms, syncs = _interleaved({v: partial(_train_step, net, opt, data, target) for v, (net, opt) in wrapped.items()},
                             device, 10 if not tiny else 2, steps)
    rows = {v: {"img_s": batch / ms[v] * 1000, "ms": ms[v], "syncs": syncs[v]} for v in wrapped}
    for _, opt in wrapped.values():
        _release(opt)
    params = sum(p.numel() for p in model.parameters())
    _emit({"rank": taco.rank(), "model": name, "params": params, "batch": batch, "rows": rows,
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (self-test)"})
    del wrapped, model
    _close()


# ---- driver side --------------------------------------------------------------------------------------------
def launch(n: int, args: list[str], env: dict[str, str], timeout: float = 600,
           script: str = __file__) -> subprocess.CompletedProcess[str]:
    """``mpiexec -n N python SCRIPT ARGS`` (this script by default) with the checkout importable and mpi4py on
    mpiexec's MPI."""
    sys.path.insert(0, str(ROOT))
    from taco_notebook.cluster.launch.mpi import find_mpi

    mpi = find_mpi()
    full = {**os.environ, **mpi.environment, **env}
    full["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.run([mpi.mpiexec, *mpi.extra_args, "-n", str(n), sys.executable, script, *args],
                          env=full, capture_output=True, text=True, timeout=timeout)


def results_of(done: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    return _results(done.stdout)


def last_line(text: object, default: str = "no message", limit: int = 160) -> str:
    """The last non-blank line of ``text`` (an exception's message, a process's stderr), at most ``limit``
    characters; ``default`` when there is none: an exception may carry an empty message, and the table must
    still say which check failed rather than fail itself (an IndexError on ``splitlines()[-1]``, seen on a GPU).

    >>> last_line("Traceback\\n  ...\\nValueError: bad\\n\\n"), last_line(""), last_line(KeyError())
    ('ValueError: bad', 'no message', 'no message')
    """
    lines = [line for line in str(text).splitlines() if line.strip()]
    return lines[-1].strip()[:limit] if lines else default


def table(header: tuple[str, ...], rows: list[tuple[Any, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def check_rows(title: str, runs: list[tuple[str, int, dict[str, str], str]], device: str) -> tuple[str, bool]:
    rows: list[tuple[Any, ...]] = []
    ok = True
    for label, n, env, worker in runs:
        done = launch(n, ["--worker", worker, "--device", device], env)
        got = results_of(done)
        if done.returncode != 0 or len(got) != n:
            ok = False
            rows.append((label, "-", "FAILED", last_line(done.stderr, "no output")))
            continue
        for row in got[0]["rows"]:
            same = all(any(r == row for r in other["rows"]) for other in got)
            passed = row["exact"] and same
            ok &= passed
            rows.append((label, row["check"], "ok" if passed else "FAILED", got[0].get("backend", "")))
    return f"### {title}\n\n" + table(("run", "check", "result", "backend"), rows), ok


def section_placement() -> tuple[str, bool]:
    import torch

    gpus = torch.cuda.device_count()
    done = launch(gpus + 1, ["--worker", "collectives"], {"TACO_GPUS": "exclusive"}, timeout=300)
    text = done.stdout + done.stderr
    found = re.search(r"node \S+ has \d+ GPUs? but \d+ ranks[^\n]*", text)
    refused = done.returncode != 0 and found is not None and "--gpus auto" in text and "--gpus none" in text
    rows = [("exclusive", gpus + 1, gpus, "ok" if refused else "FAILED",
             found.group(0)[:160] if found else last_line(text, "no output"))]
    done = launch(gpus + 1, ["--worker", "collectives"], {"TACO_GPUS": "auto"}, timeout=300)
    got = results_of(done)
    shared = (done.returncode == 0 and len(got) == gpus + 1 and all(r["exact"] for g in got for r in g["rows"])
              and got[0]["backend"] == "cpu:gloo,cuda:gloo")
    rows.append(("auto", gpus + 1, gpus, "ok" if shared else "FAILED",
                 got[0]["backend"] if got else last_line(done.stderr, "no output")))
    return "### More ranks than GPUs: exclusive refuses, auto shares\n\n" + table(
        ("--gpus", "ranks", "GPUs", "result", "message or backend"), rows), refused and shared


def section_notebooks() -> tuple[str, bool]:
    import nbformat
    from nbclient import NotebookClient

    os.environ.pop("TACO_GPUS", None)  # the examples ask for 4 ranks: the default (auto) shares a 1-GPU machine
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    rows, ok = [], True
    for path in sorted((ROOT / "examples").glob("*.ipynb")):
        notebook = nbformat.read(path, as_version=4)
        began = time.perf_counter()
        try:
            NotebookClient(notebook, timeout=900, kernel_name="python3",  # from its own directory, as nbval runs it
                           resources={"metadata": {"path": str(path.parent)}}).execute()
            rows.append((path.name, "ok", f"{time.perf_counter() - began:.0f} s"))
        except Exception as exc:  # noqa: BLE001 - reported in the table, the next notebook still runs
            ok = False
            rows.append((path.name, "FAILED", last_line(exc, type(exc).__name__)))
    return "### Example notebooks with CUDA visible (--gpus auto)\n\n" + table(
        ("notebook", "result", "time"), rows), ok


def _syncs(value: float | None) -> str:
    return "n/a (cpu)" if value is None else f"{value:g}"


def _ran(worker: str, steps: int, device: str) -> tuple[dict[str, Any] | None, str]:
    """Run ``worker`` on 1 rank; its result, or None and the reason it has none."""
    done = launch(1, ["--worker", worker, "--steps", str(steps), "--device", device], {"TACO_GPUS": "auto"},
                  timeout=900)
    got = results_of(done)
    if done.returncode != 0 or not got:
        return None, "\n".join(done.stderr.strip().splitlines()[-5:]) or "no output"
    return got[0], ""


def section_overhead(steps: int, device: str) -> tuple[str, bool]:
    got, why = _ran("overhead", steps, device)
    if got is None:
        return "### Overhead\n\nFAILED: " + why, False
    ms, syncs = got["ms"], got["syncs"]
    plain, ddp, ddp_fp16 = ms["plain SGD"], ms["DDP"], ms["DDP + torch fp16 hook"]
    rows = [(v, f"{t:.2f}", f"{t - plain:+.2f}", _syncs(syncs[v])) for v, t in ms.items()]
    goals = {f"taco <= DDP ({ddp:.2f} ms)": ms["taco"] <= ddp * 1.05,
             f"taco fp16 <= DDP + torch fp16 ({ddp_fp16:.2f} ms)": ms["taco fp16"] <= ddp_fp16 * 1.05,
             f"taco's fp16 hook <= DDP + torch fp16 ({ddp_fp16:.2f} ms)": ms["DDP + taco fp16 hook"] <= ddp_fp16 * 1.05,
             f"taco topk:0.01 <= 1.2 x DDP ({1.2 * ddp:.2f} ms)": ms["taco topk:0.01"] <= 1.2 * ddp * 1.05,
             "0 host syncs per step on every taco path": all(
                 syncs[v] in (0, None) for v in ms if v.startswith("taco") or "taco" in v)}
    kernel_rows = [(spec, f"{k['compress_ms']:.3f}", f"{k['decompress_ms']:.3f}", f"{k['wire_mb']:.2f}",
                    _syncs(k["compress_syncs"]), _syncs(k["decompress_syncs"])) for spec, k in got["kernels"].items()]
    cpu = device == "cpu"
    text = (f"### Per-step overhead, 1 rank, {got['params'] / 1e6:.1f}M parameters, {got['gpu']}\n\n"
            + table(("variant", "ms/step", "vs plain", "host syncs/step"), rows) + "\n\n"
            + "\n".join(f"- {goal} (5% noise): {'met' if met else 'NOT met'}" for goal, met in goals.items())
            + f"\n\n### Compressor kernels on a {got['params'] / 1e6:.1f}M-element float32 gradient, {got['gpu']}\n\n"
            + table(("compression", "compress ms", "decompress ms", "wire MB", "syncs (compress)",
                     "syncs (decompress)"), kernel_rows))
    return text, cpu or all(goals.values())


def section_synthetic(steps: int, device: str) -> tuple[str, bool]:
    got, why = _ran("synthetic", steps, device)
    if got is None:
        return "### Synthetic benchmark\n\nFAILED: " + why, False
    rows_in = got["rows"]
    plain = rows_in["plain torch"]["img_s"]
    rows = [(v, f"{r['img_s']:.1f}", f"{r['img_s'] / plain:.1%}", f"{r['ms']:.2f}", _syncs(r["syncs"]))
            for v, r in rows_in.items()]
    goals = {"taco >= 97% of plain torch": rows_in["taco"]["img_s"] >= 0.97 * plain,
             "taco fp16 >= 95% of plain torch": rows_in["taco fp16"]["img_s"] >= 0.95 * plain,
             "horovod face >= 97% of plain torch (>= 95% with fp16)": rows_in["horovod"]["img_s"] >= 0.97 * plain
             and rows_in["horovod fp16"]["img_s"] >= 0.95 * plain,
             "taco >= DDP": rows_in["taco"]["img_s"] >= 0.97 * rows_in["DDP"]["img_s"]}
    text = (f"### Synthetic benchmark (Horovod's shape), 1 rank, {got['model']} ({got['params'] / 1e6:.1f}M), "
            f"batch {got['batch']}, {got['gpu']}\n\n"
            + table(("variant", "img/s", "of plain", "ms/step", "host syncs/step"), rows) + "\n\n"
            + "\n".join(f"- {goal}: {'met' if met else 'NOT met'}" for goal, met in goals.items()))
    return text, device == "cpu" or all(goals.values())


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.worker:
        workers = {"collectives": lambda: worker_collectives(args.device),
                   "training": lambda: worker_training(args.device),
                   "overhead": lambda: worker_overhead(args.steps, args.device),
                   "synthetic": lambda: worker_synthetic(args.steps, args.device)}
        workers[args.worker]()
        return 0
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"skipped: no CUDA device (torch {torch.__version__}, torch.cuda.is_available() is False); "
              "run it on a GPU machine")
        return 0
    shared, auto = {"TACO_GPUS": "shared"}, {"TACO_GPUS": "auto"}
    two_nodes = {"TACO_GPUS": "shared", "LIGHT_INTRA_SIZE": "2"}
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    nccl = [(f"{gpus} ranks, auto (NCCL)", gpus, auto)] if gpus >= 2 else []  # multi-rank NCCL needs 2+ GPUs
    plans = {
        "collectives": lambda: check_rows("Exact collectives", [
            ("1 rank, auto (NCCL)", 1, auto, "collectives"), ("2 ranks, shared (gloo)", 2, shared, "collectives"),
            ("4 ranks = 2 nodes x 2, shared", 4, two_nodes, "collectives"),
            *[(*run, "collectives") for run in nccl]], args.device),
        "training": lambda: check_rows("DistributedOptimizer and DDP hook, every compression: replicas identical", [
            ("2 ranks, shared", 2, shared, "training"), *[(*run, "training") for run in nccl]], args.device),
        "placement": section_placement if args.device == "cuda" else lambda: (
            "### More ranks than GPUs\n\nskipped: needs CUDA (it places ranks on GPUs)", True),
        "notebooks": section_notebooks,
        "overhead": lambda: section_overhead(args.steps, args.device),
        "synthetic": lambda: section_synthetic(args.steps, args.device),
    }
    if args.device == "cpu":
        print("self-test on CPU tensors (no GPU used)\n")
    all_ok = True
    for name in args.sections:
        text, ok = plans[name]()
        print(text + "\n", flush=True)
        all_ok &= ok
    print("all checks passed" if all_ok else "SOME CHECKS FAILED")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
