"""The user commands beside `build` and `run`: benchmarks (`bench`, the HTTP load generator `loadgen`),
quality (`eval`), `inspect`, pass ablations (`compare`) and `export` (ONNX, TensorRT, Hugging Face).
Each reads artifacts through optc.core.artifact.read; the CLI (optc.cli) parses options and calls them.
"""
