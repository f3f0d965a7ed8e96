"""Ahead-of-time: every step program compiled for a target this machine need not be (TPU,
CUDA), and the roofline read from the compiled programs."""
