"""The processes behind a cluster: its tree, the rank wrapper, how ranks died, and teardown.

Kept import-light: ``python -m taco_notebook.engine.rankwrap`` runs on every rank at launch.
"""
