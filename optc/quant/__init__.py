"""Weight quantization, pure torch: round-to-nearest, AWQ, GPTQ, and importers for pre-quantized
checkpoints. Every function returns the stored parts of an `optc.formats.Format`; none of them
touches the IR (the passes in passes/quantize_*.py do)."""

from optc.quant.awq import (
    AwqResult,
    awq_quantize,
    fold_into_linear,
    fold_into_norm,
    search_clip,
    search_scale,
)
from optc.quant.checkpoints import CheckpointError, import_quantized
from optc.quant.gptq import Gptq, GptqResult
from optc.quant.rtn import fake_quantize, make_format, quantize_weight

__all__ = [
    "AwqResult", "CheckpointError", "Gptq", "GptqResult", "awq_quantize",
    "fake_quantize", "fold_into_linear", "fold_into_norm", "import_quantized", "make_format",
    "quantize_weight", "search_clip", "search_scale",
]
