"""The user commands beside `build`: benchmarks (`bench`, the HTTP load generator `loadgen`), quality
(`eval`), `inspect`, pass ablations (`compare`) and `export` (ONNX, TensorRT, Hugging Face). Each reads
artifacts through optc.core.artifact.read; the CLI (optc.cli) parses options and calls them. `run` and
`serve` declare their options here too (their modules hold the typer command that optc.cli registers), with
what the CLI's entries share in `cli_common` and the parallelism options in `parallel`.
"""
