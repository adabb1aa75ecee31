"""optc: a compiler-style optimization toolchain for LLM inference."""

__version__ = "0.1.0"
