"""``python -m taco_notebook.controller``: the controller process a cluster starts."""

from . import main

main()
