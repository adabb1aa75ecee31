"""`--format tensorrt`: a serialized TensorRT engine built from the portable ONNX export.

The network is strongly typed (types come from the ONNX: float32 activations, int8 and blocked int4
weights through DequantizeLinear) and has one optimization profile spanning batch 1 .. the
artifact's `runtime.max_num_seqs` and sequence 1 .. `runtime.max_seq_len` for new tokens, past
and total lengths. Building needs the `tensorrt` Python package and an NVIDIA GPU; without them
`check_tensorrt` says which is missing before any work.
"""

from __future__ import annotations

from pathlib import Path

from optc.commands.export.lower import PAST_KEY, PAST_VALUE
from optc.core.errors import UserError
from optc.core.ir import ModelConfig


def check_tensorrt() -> None:
    """Raise a UserError naming what `--format tensorrt` lacks on this machine."""
    missing = []
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        missing.append("the tensorrt Python package (pip install tensorrt)")
    import torch

    if not torch.cuda.is_available():
        missing.append("an NVIDIA GPU")
    if missing:
        raise UserError(
            f"--format tensorrt needs {' and '.join(missing)}; export the portable ONNX here with "
            f"`--format onnx --flavor portable` and build the engine where both exist"
        )


def build_engine(onnx_path: Path, engine_path: Path, cfg: ModelConfig, max_batch_size: int, max_seq_len: int) -> Path:
    """Parse `onnx_path` (its external data beside it) and write the serialized engine to `engine_path`."""
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {onnx_path}: {errors}")
    profile = builder.create_optimization_profile()
    b, s = max_batch_size, max_seq_len
    for name in ("input_ids", "position_ids"):
        profile.set_shape(name, (1, 1), (1, min(128, s)), (b, s))
    profile.set_shape("attention_mask", (1, 1), (1, min(256, s)), (b, s))
    kv = (cfg.num_kv_heads, cfg.head_dim)
    for i in range(cfg.num_layers):
        for name in (PAST_KEY.format(i), PAST_VALUE.format(i)):
            profile.set_shape(name, (1, kv[0], 0, kv[1]), (1, kv[0], min(128, s), kv[1]), (b, kv[0], s, kv[1]))
    config = builder.create_builder_config()
    config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError(f"TensorRT could not build an engine from {onnx_path} (see its log above)")
    engine_path.write_bytes(bytes(serialized))
    return engine_path
