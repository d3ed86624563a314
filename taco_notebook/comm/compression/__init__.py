"""Gradient compression: the compressor interface, none/fp16/bf16/TopK, PowerSGD, and the row layout it needs."""
