"""The cluster registry: files that tell the Jupyter server (and so the sidebar) which clusters exist, their
writer, attaching to a cluster another process owns, and the reaper that cleans up after a killed kernel.
"""
