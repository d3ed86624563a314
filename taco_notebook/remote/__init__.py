"""Helpers the notebook runs on another host over ssh (or ``ip netns exec``), outside any rank."""
