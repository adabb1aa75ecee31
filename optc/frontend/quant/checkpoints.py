"""Import pre-quantized Hugging Face checkpoints (AutoAWQ GEMM, GPTQ, compressed-tensors) into optc parts, exactly.

No requantization: the stored integers, zero points and scales are only re-laid-out into the
`int4_g` format of optc.core.formats. Every tensor named `X.qweight` is a quantized linear whose
logical weight is `X.weight`; every other tensor passes through unchanged. Layouts:

- AutoAWQ GEMM (`quant_method: awq`, `version: gemm`): `qweight` (K, N/8) int32 packed along N in
  AutoAWQ's interleaved nibble order [0, 2, 4, 6, 1, 3, 5, 7] (nibble i of word j holds column
  8j + AWQ_ORDER[i]), `qzeros` (K/G, N/8) in the same order, `scales` (K/G, N);
  w[k, n] = (q − z) · s, no offset on the zeros.
- GPTQ (`quant_method: gptq`): `qweight` (K/8, N) int32 packed along K (nibble i of row r holds
  input 8r + i), `qzeros` (K/G, N/8) packed along N in plain order, `scales` (K/G, N), `g_idx` (K,)
  the group of each input channel. `checkpoint_format: gptq` (v1, the default) stores z − 1,
  `gptq_v2` stores z. With `desc_act` g_idx is a permuted group map: the importer reorders the
  input dimension so groups are contiguous and stores a `perm` part (Format.act_order).

- compressed-tensors (`quant_method: compressed-tensors`, `pack-quantized`): optc/frontend/quant/ct_checkpoints.py,
  through the format schemes' `from_compressed_tensors`.

`import_quantized(path, cfg, files)` is what optc/frontend/sources.py calls for a HF folder whose config has
`quantization_config`: it returns a store whose qweights are converted lazily. The graph itself comes
from the model family (optc/frontend/models/).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from optc.core.errors import UserError
from optc.core.formats import INT4_GROUP_SIZES, Format, pack_int4, part_name, quantized_format
from optc.core.ir import TensorInfo
from optc.core.store import Entry, TensorStore
from optc.frontend.quant.blocks import tensor_entry
from optc.frontend.quant.ct_checkpoints import import_compressed_tensors

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AutoAWQ word holds column AWQ_ORDER[i]
GPTQ_FORMATS = ("gptq", "gptq_v2")


class CheckpointError(UserError, ValueError):
    """A pre-quantized checkpoint this importer cannot read exactly; the message names the tensor or key."""


def quantization_method(config: Mapping) -> str | None:
    """`awq`, `gptq`, `compressed-tensors`, or None for a checkpoint without `quantization_config`; errors
    name the rest."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method not in ("awq", "gptq", "compressed-tensors"):
        raise CheckpointError(f"quantization_config.quant_method {method!r} is not supported; "
                         "supported: 'awq' (AutoAWQ GEMM), 'gptq', 'compressed-tensors' (pack-quantized)")
    return method


def import_quantized(
    path: Path, cfg: dict, files: list[Path]
) -> tuple[TensorStore, dict[str, TensorInfo], dict | None]:
    """A HF folder whose config has `quantization_config` -> (store, quantized, quantization record).

    The store holds every floating-point tensor of the checkpoint under its own name plus the parts of
    each quantized linear in our formats; `quantized` maps each quantized linear's logical weight
    (`X.weight`) to its TensorInfo; the record is the manifest's `quantization` section (None when the
    config says quantized but the weights are plain, e.g. dequantized from GGUF: they load as dense).
    Small parts (scales, zeros, g_idx) are read now, to decide each linear's format; the qweights are
    converted lazily, when the store entry is loaded.
    """
    if str(cfg["quantization_config"].get("quant_method", "")).lower() == "compressed-tensors":
        return import_compressed_tensors(path, cfg, files, CheckpointError)
    raw = TensorStore.from_safetensors(files)
    bases = _quantized_bases(raw.names())
    method, group_size, v1 = None, 0, False
    if bases:  # a config that says quantized over plain weights (e.g. dequantized from GGUF) loads as dense
        method, group_size, v1 = _parse_config(cfg)
    quant_keys = {f"{b}.{r}" for b in bases for r in ("qweight", "qzeros", "scales", "g_idx")}
    dense = raw.with_entries(remove=quant_keys)
    floats = (torch.float32, torch.float16, torch.bfloat16)  # other tensors (e.g. saved test ids) are not weights
    dense = dense.keep([t for t in dense.names() if dense.entry(t).dtype in floats])
    table: dict[str, TensorInfo] = {}
    entries: dict[str, Entry] = {}
    for base in bases:
        get = lambda role, base=base: raw.get(f"{base}.{role}") if f"{base}.{role}" in raw else None
        if method == "awq":
            fmt, small = awq_small_parts(get("qzeros"), get("scales"), group_size, base)
            convert = lambda t, perm=None: awq_qweight(t)
        else:
            fmt, small = gptq_small_parts(get("qzeros"), get("scales"), get("g_idx"), group_size, v1, base)
            convert = gptq_qweight
        name = f"{base}.weight"
        n, k = small["scales"].shape[0], small["scales"].shape[1] * group_size
        table[name] = TensorInfo((n, k), fmt)
        src = raw.entry(f"{base}.qweight")
        _expect(src, (k, n // 8) if method == "awq" else (k // 8, n), base, "qweight")
        perm = small.get("perm")
        entries[part_name(name, "qweight", fmt)] = Entry((n, k // 8), torch.int32,
                                                         lambda src=src, c=convert, p=perm: c(src.load(), p))
        entries.update({part_name(name, r, fmt): tensor_entry(t) for r, t in small.items()})
    store = dense.with_entries(entries)
    quantization = None
    if method is not None:
        detail = {"checkpoint_format": "gptq" if v1 else "gptq_v2"} if method == "gptq" else {"version": "gemm"}
        quantization = {"method": method, "imported": True, "bits": 4, "group_size": group_size,
                        "linears": len(bases), **detail}
    return store, table, quantization


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """(R, C) int32 -> (R, 8C) int64 nibbles, nibble i of word c at column 8c + i."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    return ((packed.to(torch.int64)[..., None] >> shifts) & 0xF).reshape(packed.shape[0], -1)


def awq_small_parts(qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                    name: str = "weight") -> tuple[Format, dict[str, torch.Tensor]]:
    """The format, scales and zeros of an AutoAWQ GEMM linear (everything but the qweight)."""
    n = scales.shape[1]
    _expect(qzeros, (scales.shape[0], n // 8), name, "qzeros")
    z = _awq_order(unpack_rows(qzeros))  # (K/G, N)
    fmt = _int4(group_size, True, scales.dtype)
    return fmt, {"scales": scales.T.contiguous(), "zeros": z.T.contiguous().to(torch.uint8)}


def awq_qweight(qweight: torch.Tensor) -> torch.Tensor:
    """AutoAWQ qweight (K, N/8) -> k8_lsb (N, K/8)."""
    return pack_int4(_awq_order(unpack_rows(qweight)).T.contiguous())


def gptq_small_parts(qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None, group_size: int,
                     zeros_minus_one: bool = True, name: str = "weight") -> tuple[Format, dict[str, torch.Tensor]]:
    """The format, scales, zeros (unless symmetric) and perm (for desc_act) of a GPTQ linear."""
    num_groups, n = scales.shape
    k = num_groups * group_size
    _expect(qzeros, (num_groups, n // 8), name, "qzeros")
    z = unpack_rows(qzeros) + (1 if zeros_minus_one else 0)  # (K/G, N)
    if int(z.max()) > 15:
        raise CheckpointError(f"{name}: a GPTQ v1 zero point of 0 was stored as -1 (nibble 15, read as 16); "
                         "it cannot be represented in [0, 15]; re-export the checkpoint as gptq_v2")
    trivial = torch.arange(k) // group_size
    parts = {"scales": scales.T.contiguous()}
    if g_idx is not None and not torch.equal(g_idx.to(torch.int64), trivial):
        if g_idx.shape != (k,):
            raise CheckpointError(f"{name}.g_idx: shape {list(g_idx.shape)}, expected [{k}]")
        perm = torch.argsort(g_idx.to(torch.int64), stable=True)
        if not torch.equal(g_idx.to(torch.int64)[perm], trivial):
            raise CheckpointError(f"{name}: g_idx does not assign exactly {group_size} inputs to every group")
        parts["perm"] = perm.to(torch.int32)
    sym = bool((z == 8).all())
    if not sym:
        parts["zeros"] = z.T.contiguous().to(torch.uint8)
    return _int4(group_size, not sym, scales.dtype, act_order="perm" in parts), parts


def gptq_qweight(qweight: torch.Tensor, perm: torch.Tensor | None = None) -> torch.Tensor:
    """GPTQ qweight (K/8, N) -> k8_lsb (N, K/8), input columns reordered by `perm` when given."""
    if perm is None:  # packed along K in the same nibble order: a transpose is the whole conversion
        return qweight.T.contiguous()
    return pack_int4(unpack_rows(qweight.T.contiguous())[:, perm.long()])


def _parse_config(config: Mapping) -> tuple[str, int, bool]:
    """-> (method, group size, GPTQ zeros stored minus one); errors say what is supported."""
    method = quantization_method(config)
    if method is None:
        raise CheckpointError("the checkpoint's config has no quantization_config")
    qc = config["quantization_config"]
    bits = int(qc.get("bits", qc.get("w_bit", 0)))
    group_size = int(qc.get("group_size", qc.get("q_group_size", 0)))
    if bits != 4:
        raise CheckpointError(f"{method} checkpoint with bits={bits}: only 4-bit checkpoints are supported")
    if group_size not in INT4_GROUP_SIZES:
        raise CheckpointError(f"{method} checkpoint with group_size={group_size}: supported {INT4_GROUP_SIZES}")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise CheckpointError(f"AutoAWQ version {version!r} is not supported; supported: 'gemm'")
        if not qc.get("zero_point", True):
            raise CheckpointError("AutoAWQ GEMM checkpoints without zero_point are not supported")
        return method, group_size, False
    ckpt_format = str(qc.get("checkpoint_format", qc.get("format", "gptq"))).lower()
    if ckpt_format not in GPTQ_FORMATS:
        raise CheckpointError(f"GPTQ checkpoint_format {ckpt_format!r} is not supported; supported: {GPTQ_FORMATS}")
    return method, group_size, ckpt_format == "gptq"


def _quantized_bases(names) -> list[str]:
    return [k[: -len(".qweight")] for k in names if k.endswith(".qweight")]


def _awq_order(nibbles: torch.Tensor) -> torch.Tensor:
    """Undo AutoAWQ's interleave: column 8c + AWQ_ORDER[i] is nibble i of word c."""
    r, c = nibbles.shape
    out = torch.empty_like(nibbles).view(r, c // 8, 8)
    out[..., list(AWQ_ORDER)] = nibbles.view(r, c // 8, 8)
    return out.view(r, c)


def _int4(group_size: int, zero_point: bool, dtype: torch.dtype, act_order: bool = False) -> Format:
    names = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
    if dtype not in names:
        raise CheckpointError(f"scales of dtype {dtype} are not supported; supported: {list(names.values())}")
    return quantized_format(4, names[dtype], group_size, zero_point, act_order)


def _expect(t: torch.Tensor | Entry, shape: tuple[int, int], name: str, role: str) -> None:
    if tuple(t.shape) != shape:
        raise CheckpointError(f"{name}.{role}: shape {list(t.shape)}, expected {list(shape)} from the scales")
