"""Run under ``mpiexec -n 4``: bring the process group up, say so, and keep allreducing until told to stop.

Usage: ``listening_allreduce.py STOP_FILE REPORT_DIR``. Every rank writes REPORT_DIR/rank<N>.json (its
rendezvous kind and path, gloo's interface, UCX_TLS) once the group is up; the test lists the job's listening
sockets until it creates STOP_FILE.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

import taco_notebook.comm as taco
from taco_notebook.comm.group.bootstrap import state

stop_file, report_dir = sys.argv[1], sys.argv[2]
taco.init()
meeting = state.rendezvous
assert meeting is not None
report = {"rank": taco.rank(), "kind": meeting.kind, "address": meeting.address,
          "ifname": os.environ.get("GLOO_SOCKET_IFNAME"), "ucx_tls": os.environ.get("UCX_TLS")}
target = os.path.join(report_dir, f"rank{taco.rank()}.json")
with open(target + ".tmp", "w") as f:
    json.dump(report, f)
os.replace(target + ".tmp", target)  # the test never reads half a file
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
