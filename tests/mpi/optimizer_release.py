"""Run with one or more ranks: a dropped DistributedOptimizer is freed (its fusion buffers and the wrapped
optimizer's state with it) without remove_hooks(); prints 'OK <rank>'."""

from __future__ import annotations

import gc
import weakref

import torch

import taco_notebook.comm as taco

taco.init()
model = torch.nn.Linear(10, 10)
opt = taco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                named_parameters=model.named_parameters())
model(torch.randn(2, 10)).sum().backward()
opt.step()
dropped = weakref.ref(opt)
del opt
gc.collect()
assert dropped() is None, "a dropped DistributedOptimizer is still alive (its gradient hooks hold it)"
model(torch.randn(2, 10)).sum().backward()  # the parameters' old hooks now do nothing
taco.shutdown()
print(f"OK {taco.rank()}", flush=True)
