"""Engines launched through Slurm: the options, ipyparallel's launchers with a notebook's needs added, and the wait
for the queue.
"""
