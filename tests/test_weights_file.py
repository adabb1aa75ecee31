"""optc.core.weights_file: a safetensors file written a tensor at a time has save_file's bytes exactly (the
artifact's hashes do not move), whatever the dtypes and the order the tensors are produced in."""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from optc.core.weights_file import write_weights_file


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.layers.1.mlp.down_proj.weight": torch.randn(5, 7, generator=g).to(torch.bfloat16),
        "model.layers.0.self_attn.qkv.qweight": torch.randint(-128, 127, (3, 8), generator=g, dtype=torch.int8),
        "model.layers.0.self_attn.qkv.scales": torch.randn(3, 2, generator=g),
        "model.embed_tokens.weight": torch.randn(11, 4, generator=g).to(torch.float16),
        "packed": torch.randint(0, 255, (4, 3), generator=g, dtype=torch.uint8),
        "words": torch.randint(-2**30, 2**30, (2, 3), generator=g, dtype=torch.int32),
        "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "fp8": torch.randn(4, 4, generator=g).to(torch.float8_e4m3fn),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "a.weight": torch.randn(3, generator=g, dtype=torch.float64),
    }


def test_bytes_are_save_files_in_any_production_order(tmp_path):
    tensors = _tensors()
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    asked = []

    def get(name: str) -> torch.Tensor:
        asked.append(name)
        return tensors[name]

    order = sorted(tensors, key=lambda k: k[::-1])  # neither the names' order nor safetensors'
    write_weights_file(tmp_path / "out.safetensors", {k: (tuple(tensors[k].shape), tensors[k].dtype) for k in order},
                       get, metadata={"format": "pt"})
    assert asked == order
    assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_no_tensors(tmp_path):
    save_file({}, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    write_weights_file(tmp_path / "out.safetensors", {}, lambda k: None, metadata={"format": "pt"})
    assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
