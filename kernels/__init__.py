"""Kernels: one family per file, each a Triton kernel and its launcher; the torch reference each
launcher is tested against (and shares its arguments with) is its op's, in optc.core.ops."""
