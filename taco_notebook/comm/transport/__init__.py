"""How bytes move: shared memory within a node, the pipelined 2D passes, CUDA streams, and the reduction pieces."""
