"""Bringing up the ranks' process group: who is where, which GPU, the rendezvous, rebuilding it over chosen members."""
