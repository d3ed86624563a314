"""Run under ``mpiexec -n 4``: bring the process group up, say so, and keep allreducing until told to stop.

The test lists the job's listening sockets between READY and the stop file; every rank reports its
rendezvous (kind, path) so the test can check the FileStore directory's mode and its removal.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

import taco_notebook.comm as taco
from taco_notebook.comm.bootstrap import state

stop_file = sys.argv[1]
taco.init()
meeting = state.rendezvous
assert meeting is not None
report = {"rank": taco.rank(), "kind": meeting.kind, "address": meeting.address,
          "ifname": os.environ.get("GLOO_SOCKET_IFNAME"), "ucx_tls": os.environ.get("UCX_TLS")}
print("READY " + json.dumps(report), flush=True)
t = torch.ones(1 << 16)
while True:
    taco.allreduce(t, op="avg")
    done = torch.tensor([float(os.path.exists(stop_file))])
    taco.allreduce(done, op="max")  # every rank stops after the same step
    if done.item():
        break
    time.sleep(0.05)
taco.shutdown()
print(f"GONE {taco.rank()}", flush=True)
