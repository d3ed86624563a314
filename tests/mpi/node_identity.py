"""Run by ``mpiexec`` on emulated hosts (tests/cli/test_emulate.py): each rank writes
OUTDIR/<rank>.json.

It records where it runs (hostname, network namespace, the interface gloo uses, its node and local rank as
:mod:`taco_notebook.comm` sees them) and the result of a real allreduce over the shaped links. Files, not
stdout: hydra runs the ranks' lines together.
"""

from __future__ import annotations

import json
import os
import socket
import sys

import torch

import taco_notebook.comm as taco

taco.init()
rank, size = taco.rank(), taco.size()
t = torch.full((1 << 20,), float(rank + 1))
taco.allreduce(t)
expected = float(size * (size + 1) // 2)
result = {"rank": rank, "size": size, "hostname": socket.gethostname(), "netns": os.readlink("/proc/self/ns/net"),
          "uts": os.readlink("/proc/self/ns/uts"), "ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
          "node": taco.node(), "num_nodes": taco.num_nodes(), "local_rank": taco.local_rank(),
          "allreduce_ok": bool((t == expected).all()), "ssh": bool(os.environ.get("SSH_CONNECTION"))}
with open(os.path.join(sys.argv[1], f"{rank}.json"), "w", encoding="utf-8") as f:
    json.dump(result, f)
taco.shutdown()
