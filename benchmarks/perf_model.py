"""The performance model of docs/performance-model.md, on paper: every table of that page comes from here.

    python benchmarks/perf_model.py            # prints the page's tables (markdown)
    python benchmarks/perf_model.py --check    # exits 1 if the page's tables differ from what this prints

It predicts the step time of DDP (NCCL ring) and of taco's 2d allreduce (none, fp16, topk:0.01, powersgd:4) for
ResNet-50 and a 355M transformer on M nodes x 8 GPUs joined by Ethernet, from measured inputs (each named where
it is defined), and first checks the link model against the emulated-node allreduce runs in
benchmarks/results/. Plain Python and the standard library: it runs anywhere, no GPU, no torch.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "performance-model.md"
# three runs of `python -m benchmarks allreduce_bench --sizes-mib 1 16 100 --iters 7` (2 emulated nodes x 2 ranks,
# 1 Gbit/s htb links, the 2-core machine)
RUNS = tuple(Path(__file__).resolve().parent / "results" / "cpu2" / "allreduce_bench" / f"{stamp}.json"
             for stamp in ("20261125T151038", "20261125T152112", "20261125T153323"))
MB = 1e6

# ---- measured inputs (GPU: one H200, torch 2.11 + CUDA 13.0) ------------------------------------------------
CAST_MS_PER_ELEM = 0.04 / 25.2e6  # fp16 cast of a 25.2M-element fp32 gradient: 0.04 ms
TOPK_MS_PER_ELEM = 0.60 / 25.2e6  # torch.topk of 1% of 25.2M elements: 0.60 ms
# HBM rate implied by the cast (reads 4 B, writes 2 B per element), for other memory-bound passes
HBM_BYTES_PER_MS = 25.2e6 * 6 / 0.04
DDP_HOST_MS = 1.48 - 1.03  # DDP's step over plain SGD, 1 rank, 25.2M MLP: 1.48 against 1.03 ms
# taco's step over plain SGD at 1 rank with its reduction path run (no one-rank shortcut): its per-step machinery
# when it does communicate (comm thread, buckets, events): DistributedOptimizer 2.02, fp16 2.39 ms (plain 1.03)
TACO_HOST_MS = 2.02 - 1.03
TACO_FP16_HOST_MS = 2.39 - 1.03
RESNET50_STEP_MS = 32 / 1811 * 1000  # Horovod's synthetic benchmark, plain torch, batch 32: 1,811 img/s

# ---- stated assumptions (published figures, not measured here) -------------------------------------------
GPUS_PER_NODE = 8
ALPHA_STEP_MS = 0.020  # one ring step over datacenter TCP (docs/scaling.md section 6 uses the same 20 us)
NVLINK_BYTES_PER_MS = 450e9 / 1000  # H100/H200 NVLink 4: 900 GB/s bidirectional, 450 GB/s each way (NVIDIA)
LAUNCH_MS = 0.005  # host cost of one kernel launch (~5 us, PyTorch eager on a modern CPU)
# 355M transformer (GPT-2 medium: 24 layers, d=1024, vocab 50257, context 1024), 8 sequences of 1024 tokens per
# GPU per step, 6 FLOP per parameter per token, at 40% of an H100/H200's 989 TFLOP/s dense bf16 peak
TOKENS_PER_STEP = 8 * 1024
TRANSFORMER_MFU = 0.40
PEAK_FLOP_PER_MS = 989e12 / 1000
BACKWARD_SHARE = 2 / 3  # backward is ~2/3 of a step's compute (2 of the 6 FLOP per parameter are forward)


def resnet50_shapes() -> list[tuple[int, ...]]:
    """Every parameter shape of torchvision's ResNet-50 (25,557,032 parameters), without torchvision."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    cin = 64
    for blocks, width in ((3, 64), (4, 128), (6, 256), (3, 512)):
        for block in range(blocks):
            for cout, cin_, k in ((width, cin, 1), (width, width, 3), (width * 4, width, 1)):
                shapes += [(cout, cin_, k, k), (cout,), (cout,)]
            if block == 0:
                shapes += [(width * 4, cin, 1, 1), (width * 4,), (width * 4,)]
            cin = width * 4
    return shapes + [(1000, 2048), (1000,)]


def transformer_shapes(layers: int = 24, d: int = 1024, vocab: int = 50257,
                       context: int = 1024) -> list[tuple[int, ...]]:
    """GPT-2 medium's parameter shapes (354.8M with tied embeddings)."""
    shapes: list[tuple[int, ...]] = [(vocab, d), (context, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return shapes + [(d,), (d,)]


@dataclass(frozen=True)
class Model:
    name: str
    shapes: list[tuple[int, ...]]
    compute_ms: float  # forward + backward of one step on one GPU
    source: str

    @property
    def params(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    @property
    def grad_bytes(self) -> float:
        return 4.0 * self.params  # fp32 gradients, what DDP and taco reduce by default


def models() -> list[Model]:
    gpt = transformer_shapes()
    flop = 6 * sum(math.prod(s) for s in gpt) * TOKENS_PER_STEP
    return [Model("ResNet-50", resnet50_shapes(), RESNET50_STEP_MS, "measured: 1,811 img/s at batch 32, one H200"),
            Model("transformer 355M", gpt, flop / (TRANSFORMER_MFU * PEAK_FLOP_PER_MS),
                  "assumed: 6 FLOP/param/token, 8K tokens, 40% of 989 TFLOP/s")]


# ---- the link model, fitted on the emulated nodes ---------------------------------------------------------
def emulated_rows() -> list[dict[str, float | str]]:
    """(size, variant, measured median s per run, bytes over a node link) from runs A, B, C."""
    times: dict[tuple[float, str], list[float]] = {}
    link: dict[tuple[float, str], float] = {}
    for run in RUNS:
        for row in json.loads(run.read_text())["rows"]:
            if row.get("bound"):
                continue
            key = (float(row["size_mib"]), str(row["variant"]))
            times.setdefault(key, []).append(float(row["median_s"]))
            link.setdefault(key, float(row["link_bytes_per_op"]))
    return [{"size_mib": size, "variant": variant, "s": sorted(t)[len(t) // 2], "link": link[(size, variant)]}
            for (size, variant), t in times.items()]


def fit_link(rows: list[dict[str, float | str]]) -> tuple[float, float]:
    """alpha (ms) and beta (bytes/ms) of t = alpha + n / beta, least squares over gloo's rows (n: bytes over a
    node link, measured). gloo is the link and nothing else: no shared memory, no compression."""
    points = [(float(r["link"]), float(r["s"]) * 1000) for r in rows if r["variant"] == "gloo"]
    mean_n = sum(n for n, _ in points) / len(points)
    mean_t = sum(t for _, t in points) / len(points)
    slope = sum((n - mean_n) * (t - mean_t) for n, t in points) / sum((n - mean_n) ** 2 for n, _ in points)
    return mean_t - slope * mean_n, 1 / slope


def emulated_check() -> str:
    """Predicted (link model, bytes from the algorithm, not measured) against measured, on the emulated nodes."""
    rows = emulated_rows()
    alpha, beta = fit_link(rows)
    m, local = 2, 2  # 2 nodes x 2 ranks
    # bytes over a node's link per byte of S: the dense cross-node ring; half of it in fp16; TopK's allgather
    # of 1% of each local rank's shard, 8 B (value + int32 index) per 4-byte element, to M-1 peers
    per_byte = {"taco 2d": 2 * (m - 1) / m, "taco 2d+fp16": (m - 1) / m, "taco 2d+topk:0.01": 0.01 * 8 / 4 * (m - 1)}
    del local
    lines = [f"Link model fitted to gloo's rows (1, 16, 100 MiB, runs A-C): alpha = {alpha:.1f} ms, "
             f"beta = {beta * 1000 / MB:.1f} MB/s ({beta * 1000 / 125e6:.0%} of 1 Gbit/s).", "",
             "| size | variant | bytes over a node link (model) | predicted ms | measured ms (median of A-C) "
             "| measured / predicted |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        variant = str(row["variant"])
        if variant not in per_byte or float(row["size_mib"]) < 16:
            continue
        size = float(row["size_mib"]) * 1024 * 1024
        n = per_byte[variant] * size
        predicted = alpha + n / beta
        measured = float(row["s"]) * 1000
        lines.append(f"| {row['size_mib']:g} MiB | {variant} | {per_byte[variant]:.2f}×S | {predicted:.1f} | "
                     f"{measured:.1f} | {measured / predicted:.2f} |")
    return "\n".join(lines)


# ---- the cluster model ------------------------------------------------------------------------------------
def powersgd_wire(shapes: list[tuple[int, ...]], rank: int = 4) -> tuple[float, int]:
    """Bytes PowerSGD sends for a gradient of ``shapes`` (fp32 factors; 1-D and small tensors dense, as
    taco's compressor decides) and how many matrices it factorises."""
    wire, matrices = 0.0, 0
    for shape in shapes:
        numel = math.prod(shape)
        if len(shape) >= 2:
            n, m = shape[0], numel // shape[0]
            if 2 * (n + m) * rank <= n * m:
                wire += 4 * (n + m) * rank
                matrices += 1
                continue
        wire += 4 * numel
    return wire, matrices


def step_ms(model: Model, variant: str, nodes: int, gbit: float) -> float:
    """One training step on ``nodes`` x 8 GPUs: forward, then backward overlapped with the gradient
    reduction (whichever is longer), plus the host's per-step overhead of the path."""
    s, n_gpus, local = model.grad_bytes, nodes * GPUS_PER_NODE, GPUS_PER_NODE
    beta = 0.95 * gbit * 1e9 / 8 / 1000  # bytes/ms: TCP reached 95% of the htb rate on the emulated link
    elems = model.params
    if variant == "DDP":  # NCCL ring (or tree: the same ~2S through each node's NIC), over all GPUs
        steps = min(2 * (n_gpus - 1), 2 * math.ceil(math.log2(n_gpus)))  # NCCL picks ring or tree
        comm = steps * ALPHA_STEP_MS + 2 * (n_gpus - 1) / n_gpus * s / beta
        host = DDP_HOST_MS
    else:
        intra = 2 * (local - 1) / local * s / NVLINK_BYTES_PER_MS + 2 * (local - 1) * ALPHA_STEP_MS
        shard = elems / local  # what one GPU reduces across nodes (its NIC share of the node's link)
        cross = 2 * (nodes - 1) / nodes * s  # bytes the node's link carries for the dense 2d step
        latency = 2 * (nodes - 1) * ALPHA_STEP_MS
        host = TACO_HOST_MS
        if variant == "taco 2d":
            kernels = 0.0
        elif variant == "taco 2d + fp16":
            cross, kernels, host = cross / 2, 2 * shard * CAST_MS_PER_ELEM, TACO_FP16_HOST_MS
        elif variant == "taco 2d + topk:0.01":  # allgather of 1% values + int32 indices: 8 B per sent entry
            cross = (nodes - 1) * local * 0.01 * shard * 8
            latency = (nodes - 1) * ALPHA_STEP_MS
            kernels = shard * TOPK_MS_PER_ELEM + 4 * shard * 4 / HBM_BYTES_PER_MS  # select, add/fill/merge passes
        elif variant == "taco 2d + powersgd:4":  # whole tensors per GPU (DistributedOptimizer describes them)
            wire, matrices = powersgd_wire(model.shapes)
            cross = 2 * (nodes - 1) / nodes * wire
            latency = 3 * 2 * (nodes - 1) * ALPHA_STEP_MS  # dense part, every P, every Q
            kernels = 7 * 4 * shard / HBM_BYTES_PER_MS  # residual add, M Q, P^T M, residual update
            host += 10 * LAUNCH_MS * matrices / local  # ~10 launches per matrix, each GPU a share of them
        else:
            raise ValueError(f"unknown variant {variant!r}")
        comm = intra + latency + cross / beta + kernels
    forward = (1 - BACKWARD_SHARE) * model.compute_ms
    return forward + max(BACKWARD_SHARE * model.compute_ms, comm) + host


VARIANTS = ("DDP", "taco 2d", "taco 2d + fp16", "taco 2d + topk:0.01", "taco 2d + powersgd:4")


def cluster_table(model: Model) -> str:
    lines = [f"**{model.name}** ({model.params / 1e6:.1f}M parameters, {model.grad_bytes / MB:.0f} MB of fp32 "
             f"gradients; compute {model.compute_ms:.1f} ms/step, {model.source}). ms per step (× DDP's speed):", "",
             "| link | nodes × 8 | " + " | ".join(VARIANTS) + " |", "|---|---|" + "---|" * len(VARIANTS)]
    for gbit in (25, 50, 100):
        for nodes in (2, 8, 32):
            ddp = step_ms(model, "DDP", nodes, gbit)
            cells = [f"{ddp:.1f}"] + [f"{t:.1f} ({ddp / t:.2f}×)" for t in
                                      (step_ms(model, v, nodes, gbit) for v in VARIANTS[1:])]
            lines.append(f"| {gbit} Gbit | {nodes} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def page_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"<!-- perf_model -->\n(.*?)\n<!-- /perf_model -->", text, re.S)]


def generated_blocks() -> list[str]:
    """The page's generated blocks, in order: the emulated-node check, then one table per model."""
    return [emulated_check(), *(cluster_table(m) for m in models())]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with docs/performance-model.md's tables")
    args = parser.parse_args(argv)
    if args.check:
        same = page_blocks(PAGE.read_text(encoding="utf-8")) == generated_blocks()
        print("docs/performance-model.md matches" if same else "docs/performance-model.md differs: regenerate it")
        return 0 if same else 1
    print("\n\n".join(generated_blocks()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
