"""A `.gguf` file's tensors with their quantization kept: each block type -> an optc format holding its codes.

`read_gguf(path, hf_config)` maps every tensor of the file the way transformers' GGUF loader does (its name map,
built on a meta-device model, and its architecture's tensor processor: Llama's q/k row permutation, Gemma's
`norm - 1`) and returns a table of (shape, Format) and a lazy TensorStore. Float tensors (F32, F16, BF16)
become dense float32 weights, as transformers loads them. A block-quantized tensor becomes int4_gf or
int8_gf (optc/core/formats/float_groups.py) with its codes, and its fp16 factors turned into the float32
per-group scales and minimums gguf-py's dequantization computes (`BLOCKS` says which; gguf-py's quants.py is
the specification, tests/test_gguf_keep.py checks every type bit for bit). A processor that permutes whole
rows (Llama's q/k) permutes the rows of every part; one that changes a quantized tensor's values is refused
by name, as is a block type without an exact format here.

`dequantized_gguf(path, hf_config)` is `source_quantization: dequantize`: every tensor a float32 entry that
dequantizes its blocks from the mapped file when it is read (gguf-py's `dequantize`, then transformers' processor:
the values transformers' loader gives, tests/test_gguf_keep.py), so a build holds the tensors it is working on,
not the whole model in float32. `read_header` parses the file's header itself: gguf-py's reader parses every
metadata array.
"""

from __future__ import annotations

import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from optc.core.errors import UserError
from optc.core.formats import INT4_PACKING, Format, FormatKind, pack_int4, part_name
from optc.core.ir import TensorInfo
from optc.core.store import Entry, TensorStore

FLOAT_TYPES = ("F32", "F16", "BF16")
K_SCALE_SIZE = 12  # bytes of a K-quant super-block's packed 6-bit scales and minimums


class GgufError(UserError, ValueError):
    """A GGUF file optc cannot keep as it is; the message names the file, the tensor and its type."""


@dataclass(frozen=True)
class Block:
    """How one GGUF block type is kept: its format's kind, group width and whether it has minimums."""

    kind: FormatKind
    group_size: int
    zero_point: bool

    def format(self) -> Format:
        bits = 4 if self.kind is FormatKind.INT4_GF else 8
        packing = INT4_PACKING if bits == 4 else None
        return Format(self.kind, "float32", bits=bits, group_size=self.group_size, zero_point=self.zero_point,
                      packing=packing)


BLOCKS = {
    "Q4_0": Block(FormatKind.INT4_GF, 32, False),  # d * (u - 8)
    "Q4_1": Block(FormatKind.INT4_GF, 32, True),  # (d * u) + m
    "Q4_K": Block(FormatKind.INT4_GF, 32, True),  # ((d * sc) * u) - (dmin * mn): minimum -(dmin * mn)
    "Q8_0": Block(FormatKind.INT8_GF, 32, False),  # d * q
    "Q5_0": Block(FormatKind.INT8_GF, 32, False),  # d * (u - 16): code u - 16 widened to int8
    "Q5_1": Block(FormatKind.INT8_GF, 32, True),  # (d * u) + m
    "Q5_K": Block(FormatKind.INT8_GF, 32, True),  # as Q4_K with 5-bit codes
    "Q6_K": Block(FormatKind.INT8_GF, 16, False),  # (d * sc) * (u - 32), 16 sub-blocks of 16
}


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of a GGUF file, from its header: its raw data is mapped, not read."""

    name: str
    qtype: str  # GGMLQuantizationType name: F32, Q4_K, ...
    shape: tuple[int, ...]  # (N, K): GGUF lists dims fastest first, this is the reverse
    data: np.ndarray  # (N, bytes per row) uint8 for a block type; (N, K) for a float type

    @property
    def num_weights(self) -> int:
        return int(np.prod(self.shape))


def read_header(path: Path) -> tuple[str, list[GgufTensor]]:
    """A GGUF file's architecture (`general.architecture`) and tensors, their data memory-mapped. Only the
    header is parsed: gguf-py's reader parses every metadata array (the tokenizer's too), seconds per file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    meta, infos = {}, []
    with open(path, "rb") as f:
        magic, _, num_tensors, num_kv = struct.unpack("<4sIQQ", f.read(24))
        if magic != b"GGUF":
            raise GgufError(f"{path} is not a GGUF file (it starts with {magic!r})")
        for _ in range(num_kv):
            key = _string(f)
            value = _value(f, struct.unpack("<I", f.read(4))[0])
            if key in ("general.architecture", "general.alignment"):
                meta[key] = value
        for _ in range(num_tensors):
            name = _string(f)
            (num_dims,) = struct.unpack("<I", f.read(4))
            dims = struct.unpack(f"<{num_dims}Q", f.read(8 * num_dims))
            qtype, offset = struct.unpack("<IQ", f.read(12))
            infos.append((name, GGMLQuantizationType(qtype), tuple(reversed(dims)), offset))
        align = meta.get("general.alignment", 32)
        start = -(-f.tell() // align) * align  # the data section starts at the next multiple of the alignment
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = []
    for name, qtype, shape, offset in infos:
        block_weights, block_bytes = GGML_QUANT_SIZES[qtype]
        row_bytes = shape[-1] // block_weights * block_bytes
        rows = int(np.prod(shape[:-1]))
        data = raw[start + offset:start + offset + rows * row_bytes].reshape(rows, row_bytes)
        if qtype.name in FLOAT_TYPES:
            data = data.view({"F32": np.float32, "F16": np.float16, "BF16": np.uint16}[qtype.name])
        tensors.append(GgufTensor(name, qtype.name, shape, data))
    return str(meta.get("general.architecture", "")), tensors


def tensor_types(path: Path) -> dict[str, int]:
    """How many of the file's tensors are stored in each GGUF type (F32, Q4_K, ...)."""
    return dict(sorted(Counter(t.qtype for t in read_header(path)[1]).items()))


def read_gguf(path: Path, hf_config) -> tuple[dict[str, TensorInfo], TensorStore, dict[str, int]]:
    """The file's tensors under transformers' names (`hf_config`: its transformers config) -> (table, store,
    how many of the file's tensors each GGUF type holds)."""
    import gguf

    arch, tensors = read_header(path)
    for t in tensors:  # refuse before any heavy work
        if t.qtype not in (*FLOAT_TYPES, *BLOCKS):
            raise GgufError(f"{path}: tensor {t.name} is {t.qtype}, which optc cannot keep exactly (kept "
                            f"types: {', '.join(BLOCKS)}; float: {', '.join(FLOAT_TYPES)}); build with "
                            f"`source_quantization: dequantize`")
    names, processor = _name_map(hf_config, arch)
    table, entries, last = {}, {}, {}  # last: the one tensor whose parts are decoded, shared by its entries
    for t in tensors:
        if t.qtype in FLOAT_TYPES:
            weights = gguf.quants.dequantize(t.data, gguf.GGMLQuantizationType[t.qtype])
            out = processor.process(weights=weights.reshape(t.shape), name=t.name, tensor_key_mapping=names,
                                    parsed_parameters={})
            if out.name in names:
                dense = torch.from_numpy(np.array(out.weights, dtype=np.float32, copy=True)).reshape(t.shape)
                table[names[out.name]] = TensorInfo(t.shape, Format())
                entries[names[out.name]] = Entry(t.shape, torch.float32, lambda d=dense: d)
            continue
        name, rows = _rows(processor, names, t.name, t.shape[0], path)
        if name is None:
            continue
        fmt = BLOCKS[t.qtype].format()
        fmt.check_shape(t.shape, f"{path}: tensor {t.name}")
        decode = _Decoded(t.data, t.qtype, t.shape, rows, last)
        table[name] = TensorInfo(t.shape, fmt)
        for role, (pshape, dtype) in fmt.part_shapes(t.shape).items():
            entries[part_name(name, role, fmt)] = Entry(pshape, dtype, lambda d=decode, r=role: d.part(r))
    return table, TensorStore(entries), dict(sorted(Counter(t.qtype for t in tensors).items()))


def dequantized_gguf(path: Path, hf_config) -> tuple[dict[str, TensorInfo], TensorStore]:
    """The file's tensors under transformers' names, each a lazy float32 entry: (table, store)."""
    arch, tensors = read_header(path)
    names, processor = _name_map(hf_config, arch)
    table, entries = {}, {}
    for t in tensors:
        name, _ = _rows(processor, names, t.name, t.shape[0], path, values_may_change=True)
        if name is None:
            continue
        table[name] = TensorInfo(t.shape, Format())
        entries[name] = Entry(t.shape, torch.float32, lambda t=t: _dequantized(t, processor, names))
    return table, TensorStore(entries)


def decode_blocks(raw: torch.Tensor, qtype: str, shape: tuple[int, int]) -> dict[str, torch.Tensor]:
    """A GGUF tensor's raw blocks (N, bytes per row) uint8 -> the parts of its `BLOCKS` format."""
    n, k = shape
    blocks = raw.reshape(n * k // _BLOCK_WEIGHTS[qtype], -1)  # (num_blocks, type size)
    codes, scales, mins = _DECODERS[qtype](blocks)  # codes (B, W); scales, mins (B, W / G) fp32
    block = BLOCKS[qtype]
    g = block.group_size
    parts = {"scales": scales.reshape(n, k // g).contiguous()}
    if block.zero_point:
        parts["mins"] = mins.reshape(n, k // g).contiguous()
    codes = codes.reshape(n, k)
    parts["qweight"] = pack_int4(codes) if block.kind is FormatKind.INT4_GF else codes.to(torch.int8)
    return parts


# --- private helpers ---------------------------------------------------------------------------

_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> bytes
_UINT32, _STRING, _ARRAY = 4, 8, 9


def _string(f) -> str:
    return f.read(struct.unpack("<Q", f.read(8))[0]).decode("utf-8", errors="replace")


def _value(f, vtype: int):
    """A metadata value: a string, a uint32 (the alignment) as an int, other scalars as bytes; an array is
    skipped (None), an array of scalars without reading it."""
    if vtype == _STRING:
        return _string(f)
    if vtype == _ARRAY:
        etype, count = struct.unpack("<IQ", f.read(12))
        if etype in _SCALAR_BYTES:
            f.seek(count * _SCALAR_BYTES[etype], 1)
        else:
            for _ in range(count):
                _value(f, etype)
        return None
    raw = f.read(_SCALAR_BYTES[vtype])
    return int.from_bytes(raw, "little") if vtype == _UINT32 else raw


class _Decoded:
    """One tensor's parts, decoded on the first part asked for and kept in `last` (shared by one file's
    tensors) until another tensor's are asked: the artifact writer asks for a tensor's parts one after another."""

    def __init__(self, data: np.ndarray, qtype: str, shape: tuple[int, ...], rows: torch.Tensor | None,
                 last: dict):
        self.data, self.qtype, self.shape, self.rows, self.last = data, qtype, shape, rows, last

    def part(self, role: str) -> torch.Tensor:
        if self.last.get("owner") is not self:
            raw = torch.from_numpy(np.array(self.data, dtype=np.uint8, copy=True))  # the file is mapped read-only
            parts = decode_blocks(raw, self.qtype, self.shape)
            if self.rows is not None:  # whole rows permuted: every part's rows, the codes unchanged
                parts = {r: p.index_select(0, self.rows).contiguous() for r, p in parts.items()}
            self.last.update(owner=self, parts=parts)
        return self.last["parts"][role]


def _dequantized(t: GgufTensor, processor, names: dict[str, str]) -> torch.Tensor:
    """One tensor as transformers' GGUF loader makes it: gguf-py's float32 values, then the processor's changes."""
    import gguf

    weights = gguf.quants.dequantize(t.data, gguf.GGMLQuantizationType[t.qtype]).reshape(t.shape)
    out = processor.process(weights=weights, name=t.name, tensor_key_mapping=names, parsed_parameters={})
    return torch.from_numpy(np.array(out.weights, dtype=np.float32, copy=True)).reshape(t.shape)


def _name_map(hf_config, arch: str):
    """transformers' GGUF name -> HF name map and tensor processor for the file's architecture, as
    transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint picks them. The map is its
    `get_gguf_hf_weights_map` over the model's own parameter names; transformers then walks every submodule
    again under its prefix (for checkpoints converted from a base model), which maps nothing new for these
    families and costs seconds (tests/test_gguf_keep.py holds SmolLM2's map to transformers' loaded weights)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    # the processor is picked by the file's architecture
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=hf_config.to_dict())
    gguf_arch = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    name_map = get_tensor_name_map(gguf_arch, hf_config.num_hidden_layers)
    names = {}
    for hf_name in model.state_dict():
        stem, _, suffix = processor.preprocess_name(hf_name).rpartition(".")
        gguf_name = name_map.get_name(stem)
        if gguf_name is not None:
            names[f"{gguf_name}.{suffix}"] = hf_name
    return names, processor


def _rows(processor, names: dict[str, str], gguf_name: str, n: int, path: Path,
          values_may_change: bool = False) -> tuple[str | None, torch.Tensor | None]:
    """The HF name of a quantized tensor and the row permutation transformers' processor applies to it
    (None: rows as stored), found by processing the row numbers; a processor that changes values is refused
    unless `values_may_change` (then only the name is meant)."""
    probe = np.arange(n, dtype=np.float32).reshape(n, 1)
    out = processor.process(weights=probe, name=gguf_name, tensor_key_mapping=names, parsed_parameters={})
    if out.name not in names:
        return None, None
    if values_may_change:
        return names[out.name], None
    got = np.asarray(out.weights).reshape(-1)
    if got.shape != (n,) or not np.array_equal(np.sort(got), probe[:, 0]):
        raise GgufError(f"{path}: tensor {gguf_name}: transformers' loader changes its values (not only the order "
                        f"of its rows), so its quantization cannot be kept; build with "
                        f"`source_quantization: dequantize`")
    if np.array_equal(got, probe[:, 0]):
        return names[out.name], None
    return names[out.name], torch.from_numpy(got.astype(np.int64))


def _f16(b: torch.Tensor) -> torch.Tensor:
    """(B, 2) uint8 little-endian fp16 -> (B, 1) float32."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, width: int) -> torch.Tensor:
    """(B, n * width / 2) bytes -> (B, n * width) as gguf lays them out: per `width / 2` bytes, the low
    nibbles are the first `width / 2` values, the high ones the next."""
    b = qs.shape[0]
    q = qs.reshape(b, -1, 1, width // 2) >> torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 2, 1)
    return (q & 0xF).reshape(b, -1)


def _bits(qh: torch.Tensor, count: int) -> torch.Tensor:
    """(B, count / 8) bytes -> (B, count) bits, little-endian within each 4-byte word (gguf's qh: bit i of
    the word is value i)."""
    b = qh.shape[0]
    words = qh.contiguous().view(torch.int32).reshape(b, -1, 1)
    return ((words >> torch.arange(32, dtype=torch.int32)) & 1).reshape(b, count).to(torch.uint8)


def _q4_0(b):
    return _nibbles(b[:, 2:], 32), _f16(b[:, :2]), None


def _q4_1(b):
    return _nibbles(b[:, 4:], 32), _f16(b[:, :2]), _f16(b[:, 2:4])


def _q5_0(b):
    u = _nibbles(b[:, 6:], 32) | (_bits(b[:, 2:6], 32) << 4)
    return u.to(torch.int16) - 16, _f16(b[:, :2]), None


def _q5_1(b):
    return _nibbles(b[:, 8:], 32) | (_bits(b[:, 4:8], 32) << 4), _f16(b[:, :2]), _f16(b[:, 2:4])


def _q8_0(b):
    return b[:, 2:].contiguous().view(torch.int8), _f16(b[:, :2]), None


def _k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_K / Q5_K super-block's per-32 scale d * sc and minimum -(dmin * mn), float32 (B, 8); and the rest."""
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    s = b[:, 4:4 + K_SCALE_SIZE].reshape(-1, 3, 4)
    lo, hi, mix = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], -1).float()
    mn = torch.cat([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], -1).float()
    return d * sc, -(dmin * mn), b[:, 4 + K_SCALE_SIZE:]


def _q4_k(b):
    scales, mins, qs = _k_scales(b)
    return _nibbles(qs, 64), scales, mins


def _q5_k(b):
    scales, mins, rest = _k_scales(b)
    qh = rest[:, :32].reshape(-1, 1, 32) >> torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)
    return _nibbles(rest[:, 32:], 64) | ((qh & 1).reshape(-1, 256) << 4), scales, mins


def _q6_k(b):
    ql = _nibbles(b[:, :128], 128)  # (B, 256): per 64 bytes, 64 low nibbles then 64 high ones
    qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    u = ql | ((qh & 3).reshape(-1, 256) << 4)
    scales = _f16(b[:, 208:210]) * b[:, 192:208].contiguous().view(torch.int8).float()
    return u.to(torch.int16) - 32, scales, None


_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0, "Q4_K": _q4_k,
             "Q5_K": _q5_k, "Q6_K": _q6_k}
_BLOCK_WEIGHTS = {"Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32, "Q4_K": 256, "Q5_K": 256,
                  "Q6_K": 256}
