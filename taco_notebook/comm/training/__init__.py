"""Training over the collectives: the distributed optimizer, DDP hooks, gradient fusion, elastic state, the advisor."""
