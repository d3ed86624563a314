"""TopK's selection per device: the CPU-tuned sampled selection against ``torch.topk``, ms (best and median).

    python benchmarks/topk_select.py                 # CPU, one thread; CUDA too when there is a GPU

Why it exists: CUDA tensors take ``torch.topk`` (no host sync) and CPU tensors the sampled selection where it
is faster; this measures both on each device. Results: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from taco_notebook.comm.compression.compressors import TopKState  # noqa: E402
from taco_notebook.comm.compression.selection import _device_top, _sampled_top  # noqa: E402


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> tuple[float, float]:
    def wait() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    fn()
    wait()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        wait()
        times.append((time.perf_counter() - began) * 1000)
    return min(times), sorted(times)[len(times) // 2]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[2.0, 25.2], help="millions of elements")
    parser.add_argument("--ratio", type=float, default=0.01)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    print("| device | elements | sampled selection ms (best / median) | torch.topk ms (best / median) |")
    print("|---|---|---|---|")
    for device in devices:
        for millions in args.sizes:
            n = int(millions * 1e6)
            values = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(device)
            k = math.ceil(args.ratio * n)
            state = TopKState(args.ratio, 0, True)
            cells = [timed(partial(select, values, k, state), device, args.repeats)
                     for select in (_sampled_top, _device_top)]
            print(f"| {device.type} | {millions:g}M | " + " | ".join(f"{b:.2f} / {m:.2f}" for b, m in cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
