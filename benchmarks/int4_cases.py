"""benchmarks/kernels.py's int4 rows beside `w4a16.*` and `tinygemm.*`, on the same codes, scales and zero points:
the n8_tiles kernels (`w4a16_decode.*`, `w4a16_prefill.*`) and GemLite's A16W4 (`gemlite.*`) where the `gemlite`
package imports. Each function yields kernels.py's cases: (kernel, shape, bytes moved, kernel fn, torch fn).
"""

from __future__ import annotations

from functools import partial as bind

import torch


def int4_tiles_cases(lin, t, n, k, group, p4, fmt4, x, io):
    """The n8_tiles kernels (kernels/w4a16_tiles.py) on the w4a16 rows' weights, laid out: the decode launch at
    M <= 32 and the GEMM at M >= 32 (both at 32, near the default per-M table's boundary). Bytes: the codes, one
    4-byte scale/zero word per row and group, x and y."""
    from optc.core.formats import linear_ref, tile_int4, tiles_format
    from optc.kernels import w4a16_tiles

    fmt = tiles_format(fmt4)
    tiled = tile_int4(p4, fmt)
    byts, shape = n * k // 2 + n * (k // group) * 4 + io, f"M={t} N={n} K={k}"
    for name, launch, rows in (("decode", w4a16_tiles.w4a16_decode_linear, t <= 32),
                               ("prefill", w4a16_tiles.w4a16_prefill_linear, t >= 32)):
        if rows:
            yield f"w4a16_{name}.{lin}", shape, byts, bind(launch, x, tiled, fmt), bind(linear_ref, x, p4, fmt4)


def gemlite_cases(lin, t, n, k, group, p4, fmt4, x, io):
    """GemLite's A16W4 (`pip install gemlite`: pure Triton, docs/PERF.md) on the same codes, scales and zero
    points, when it imports: its own packing, made by `GemLiteLinear.pack` (W = (q - z) s, its default FMA form
    q s + (-z s)). Bytes: the codes, a scale and a zero in x's dtype per row and group, x and y."""
    try:
        from gemlite import DType, GemLiteLinear
    except ImportError:
        return
    from optc.core.formats import linear_ref, unpack_int4

    dtype = {torch.float16: DType.FP16, torch.bfloat16: DType.BF16}[x.dtype]
    layer = GemLiteLinear(4, group_size=group, in_features=k, out_features=n, input_dtype=dtype, output_dtype=dtype)
    layer.pack(unpack_int4(p4["qweight"]), p4["scales"], p4["zeros"].to(x.dtype), None)
    yield f"gemlite.{lin}", f"M={t} N={n} K={k}", n * k // 2 + n * (k // group) * 2 * x.dtype.itemsize + io, \
        bind(layer, x), bind(linear_ref, x, p4, fmt4)
