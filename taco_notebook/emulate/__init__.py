"""Emulated nodes: network namespaces, a bridge, rate-limited links and an sshd per node, on one machine.

A tool beside production, for tests, benchmarks and trying multi-node on a laptop: no production module imports it.
"""
