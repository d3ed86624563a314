"""The debugger for N ranks, the notebook's side: a post-mortem pdb on a failed rank (:mod:`.postmortem`), an
expression read from every rank while a cell runs (:mod:`.peek`), and a value compared across ranks
(:mod:`.diff`). The ranks' sides are :mod:`taco_notebook.engine.postmortem`,
:mod:`taco_notebook.comm.diagnostics.peek` and :mod:`taco_notebook.engine.fingerprint`."""
