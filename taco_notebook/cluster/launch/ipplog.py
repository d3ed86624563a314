"""The logger ipyparallel writes to for taco's clusters (``Cluster(log=IPP_LOG)``)."""

from __future__ import annotations

import logging

__all__ = ["IPP_LOG"]

# ipyparallel's own log for our clusters. Left to choose, it logs to the running traitlets Application's logger:
# in a Jupyter server (the sidebar's clusters) that is the server's, whose level makes ipyparallel copy every line
# the controller and the ranks print (the hub's 'unhandled iopub msg_type: data_message' for each metrics
# message, the engines' start-up chatter) into the server's log, and dump their output there as a warning when
# they exit by signal. What the ranks print stays in their log files (engine_output); failures reach the user as
# taco's own errors, so only ipyparallel's errors are worth a line here.
IPP_LOG = logging.getLogger("taco_notebook.ipyparallel")
IPP_LOG.setLevel(logging.ERROR)


def _not_a_removal_race(record: logging.LogRecord) -> bool:
    """False for ipyparallel's 'Failed to remove LOG: [Errno 2]': a launcher's exit watcher and its stop both
    read and remove the process's output file, and the later of the two finds it gone, as both wanted."""
    message = record.getMessage()
    return not (message.startswith("Failed to remove ") and "[Errno 2]" in message)


IPP_LOG.addFilter(_not_a_removal_race)
