"""What the DDP hook's per-call bucket check costs (taco_notebook.comm.training.hooks._bucket_name), on one gloo rank.

The hook looks at which parameters every bucket packs on every call (DDP may rebuild its buckets: after the first
iteration, and when its process group is replaced), so this is paid per bucket per step on the gradient path.

    python benchmarks/ddp_hook_describe.py [--tensors 200] [--calls 1000]
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations against the real classes.
import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from taco_notebook.comm.training import hooks


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=200, help="parameter tensors in the one bucket (even)")
    parser.add_argument("--calls", type=int, default=1000, help="checks timed per backward")
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(args.tensors // 2)])
        ddp = DistributedDataParallel(model, bucket_cap_mb=1000)  # one bucket holding every tensor
        state = hooks.TacoHookState(compression="none")
        per_call: list[float] = []

        def timed(_, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations: strings here (future import)
            began = time.perf_counter()
            for _ in range(args.calls):
                hooks._bucket_name(state, bucket)
            per_call.append((time.perf_counter() - began) / args.calls * 1e6)
            done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done

        ddp.register_comm_hook(None, timed)
        for _ in range(3):  # the second backward runs on the rebuilt buckets
            ddp(torch.randn(8, 64)).sum().backward()
        print("| tensors in the bucket | µs per check, backward 1 / 2 / 3 | µs per tensor |")
        print("|---|---|---|")
        print(f"| {args.tensors} | {' / '.join(f'{x:.0f}' for x in per_call)} | {per_call[-1] / args.tensors:.2f} |")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
