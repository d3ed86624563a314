"""Collectives over the ranks: allreduce (flat and 2D), broadcast, gather, scatter, sub-groups, and the agreement
check."""
