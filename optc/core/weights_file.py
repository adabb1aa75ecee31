"""Write one safetensors file a tensor at a time: the bytes `safetensors.torch.save_file` writes, without
holding every tensor of the file at once.

The header is computed from the tensors' declared shapes and dtypes before any tensor exists: the order of the
tensors in it (and so their offsets) is the one safetensors' own serializer gives (by dtype, then name), asked of
it with one-element tensors; shapes and offsets are then filled in and the JSON written as it writes it (compact,
padded with spaces to a multiple of 8 bytes). Each tensor is then produced in the caller's order, written at its
offset and dropped. Where the header safetensors writes for the probe is not the one this module would write (a
safetensors whose format moved on), the file is written by `save_file` from all the tensors at once, so the bytes
never depend on this module. What this module does not do: read, or check a tensor's bytes (the store's `get`
checks its shape and dtype against its entry).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors.torch import save, save_file

HEADER_ALIGN = 8  # safetensors pads its JSON header to a multiple of 8 bytes


def write_weights_file(path: Path, specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                       get: Callable[[str], torch.Tensor], metadata: dict[str, str]) -> None:
    """Write the tensors `specs` names ((shape, dtype) each) to `path`, asking `get(name)` for each in the order of
    `specs` and keeping none after it is written."""
    probe = save({k: torch.zeros(1, dtype=dtype) for k, (_, dtype) in specs.items()}, metadata=metadata)
    probe_header = probe[8:8 + int.from_bytes(probe[:8], "little")]
    order = json.loads(probe_header)
    if _header({k: (1,) for k in specs}, order) != probe_header:  # a header this module does not know how to write
        save_file({k: get(k).contiguous() for k in specs}, str(path), metadata=metadata)
        return
    header = _header({k: shape for k, (shape, _) in specs.items()}, order)
    offsets = {k: tuple(v["data_offsets"]) for k, v in json.loads(header).items() if k != "__metadata__"}
    start = 8 + len(header)
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        f.truncate(start + max((end for _, end in offsets.values()), default=0))
        for name in specs:
            t = get(name).contiguous()
            begin, end = offsets[name]
            data = t.reshape(-1).view(torch.uint8)
            if data.numel() != end - begin:
                raise ValueError(f"{path.name}: tensor {name!r} has {data.numel()} bytes, the header {end - begin}")
            f.seek(start + begin)
            f.write(data.numpy().data)
            del t, data


def _header(shapes: Mapping[str, tuple[int, ...]], order: dict) -> bytes:
    """The JSON header for tensors of `shapes`, in the order (and with the dtypes and metadata) of `order`, a
    header safetensors wrote; padded with spaces to HEADER_ALIGN."""
    doc, offset = {}, 0
    for name, info in order.items():
        if name == "__metadata__":
            doc[name] = info
            continue
        numel = 1
        for s in shapes[name]:
            numel *= s
        nbytes = numel * _ITEMSIZE[info["dtype"]]
        doc[name] = {"dtype": info["dtype"], "shape": list(shapes[name]), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()
    return text + b" " * (-len(text) % HEADER_ALIGN)


_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
             "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
