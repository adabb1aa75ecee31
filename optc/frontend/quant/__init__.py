"""Weight quantization, pure torch: round-to-nearest, AWQ, GPTQ, and the importer of pre-quantized
checkpoints. The quantizers return the stored parts of an `optc.core.formats.Format`; the options the
quantization passes share and the linears they quantize are in `options`; running a graph block by
block on calibration tokens is `blocks`. Rewriting the IR is the passes' job (passes/quantize_*.py)."""

from optc.frontend.quant.awq import fold_into_linear, fold_into_norm, search_clip, search_scale
from optc.frontend.quant.checkpoints import CheckpointError, import_quantized
from optc.frontend.quant.gptq import Gptq, GptqResult
from optc.frontend.quant.options import WeightQuantOptions
from optc.frontend.quant.rtn import fake_quantize, make_format, quantize_weight

__all__ = [
    "CheckpointError", "Gptq", "GptqResult", "WeightQuantOptions", "fake_quantize", "fold_into_linear",
    "fold_into_norm", "import_quantized", "make_format", "quantize_weight", "search_clip", "search_scale",
]
