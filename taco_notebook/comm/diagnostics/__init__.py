"""What a rank tells about itself: metrics, progress, the stall watchdog, the autopsy listener, the replica check."""
