"""Kernels: one family per file; each Triton kernel beside its torch reference."""
