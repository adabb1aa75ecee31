"""The Triton kernel registry: which kernel supports which node, and binding by name."""

import importlib
import inspect
import subprocess
import sys

import pytest

from optc.formats import Format, FormatKind
from optc.kernels.registry import KERNELS, KernelQuery, impls, select
from optc.ops import OPS


def _int4(group):
    return Format(FormatKind.INT4_G, dtype="bfloat16", bits=4, group_size=group, packing="k8_lsb")


def test_registry_kernel_names_and_ops():
    assert all(name.startswith("triton.") for name in KERNELS)
    assert {k.op for k in KERNELS.values()} == {"rms_norm", "add_rms_norm", "silu_mul", "rope", "rope_kv_store",
                                                "attention", "linear"}


def test_registry_selects_w4a16_only_when_groups_divide_k():
    ok = KernelQuery("linear", "bfloat16", _int4(128), (4096, 4096))
    assert select(ok).name == "triton.w4a16"
    assert select(KernelQuery("linear", "bfloat16", _int4(128), (4096, 4160))) is None
    int8 = Format(FormatKind.INT8_WO, dtype="float16", bits=8)
    assert select(KernelQuery("linear", "float16", int8, (64, 64))).name == "triton.w8a16"
    assert select(KernelQuery("linear", "float16", Format(dtype="float16"), (64, 64))) is None  # dense: cuBLAS


@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads,expected", [
    (128, 32, 8, "triton.paged_attention"), (64, 9, 3, "triton.paged_attention"), (16, 4, 2, "triton.paged_attention"),
    (96, 32, 8, None), (512, 8, 8, None), (8, 4, 4, None), (128, 128, 1, None),
])
def test_registry_attention_support_by_head_dim_and_group(head_dim, num_heads, num_kv_heads, expected):
    q = KernelQuery("attention", "bfloat16", num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                    kv_dtype="bfloat16", kv_block_size=16)
    assert (select(q).name if select(q) else None) == expected


def test_registry_rejects_unknown_dtype_and_hidden_size():
    assert select(KernelQuery("rms_norm", "float64", hidden_size=64)) is None
    assert select(KernelQuery("rms_norm", "float16", hidden_size=32768)) is None
    assert select(KernelQuery("rms_norm", "float16", hidden_size=4096)).name == "triton.rms_norm"
    assert select(KernelQuery("embedding", "float16")) is None


def test_registry_impls_binds_every_kernel_and_refuses_unknown_names():
    bound = impls(set(KERNELS))
    assert set(bound) == set(KERNELS) and all(callable(f) for f in bound.values())
    with pytest.raises(ValueError, match="triton.nope"):
        impls({"triton.nope"})


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_registry_launchers_take_their_op_references_arguments(name):
    # one adapter per op serves the reference and the launcher: the launcher's leading parameters are
    # the reference's (extra trailing ones are tuning overrides with defaults)
    spec = KERNELS[name]
    module, function = spec.launcher.split(":")
    launcher = inspect.signature(getattr(importlib.import_module(f"optc.kernels.{module}"), function)).parameters
    reference = inspect.signature(OPS[spec.op].reference).parameters
    assert list(launcher)[:len(reference)] == list(reference)
    assert all(p.default is not inspect.Parameter.empty for p in list(launcher.values())[len(reference):])


def test_registry_import_does_not_import_triton():
    code = "import sys, optc.kernels.registry; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
