"""The run-plan layer: from a run's options to a cluster and the options of one run, shared by the magics
(:mod:`taco_notebook.magics`, their IPython face) and the command line (:mod:`taco_notebook.cli`).

No IPython here: a user's mistake is an :class:`~taco_notebook.errors.OptionError`, which each face shows in its
own way. Kept import-light; import the modules themselves (:mod:`.runplan`, :mod:`.clusters`, :mod:`.settings`).
"""

from __future__ import annotations

__all__: list[str] = []
