"""The Triton kernel registry: which kernel supports which node, and binding by name."""

import importlib
import inspect
import subprocess
import sys
from dataclasses import replace

import pytest

from optc.core.formats import Format, FormatKind
from optc.core.ops import OPS
from optc.kernels.registry import GATED_ACTS, KERNELS, TARGETS, KernelQuery, PreparedImpl, impls, select


def _int4(group):
    return Format(FormatKind.INT4_G, dtype="bfloat16", bits=4, group_size=group, packing="k8_lsb")


def test_registry_kernel_names_and_ops():
    # cuda: a Triton kernel, or a binding of a torch library matmul (W8A8); cpu: named after its target
    prefixes = {"cuda": ("triton", "torch"), "cpu": ("cpu",)}
    assert all(name.split(".")[0] in prefixes[k.target] for name, k in KERNELS.items())
    assert {k.op for k in KERNELS.values()} == {"rms_norm", "add_rms_norm", "gated_act", "rope", "rope_kv_store",
                                                "attention", "linear", "lm_head", "moe", "mla_attention"}


def test_registry_selects_w4a16_only_when_groups_divide_k():
    ok = KernelQuery("linear", "bfloat16", _int4(128), (4096, 4096))
    assert select(ok, "cuda").name == "triton.w4a16"
    assert select(KernelQuery("linear", "bfloat16", _int4(128), (4096, 4160)), "cuda") is None
    int8 = Format(FormatKind.INT8_WO, dtype="float16", bits=8)
    assert select(KernelQuery("linear", "float16", int8, (64, 64)), "cuda").name == "triton.w8a16"
    assert select(KernelQuery("linear", "float16", Format(dtype="float16"), (64, 64)), "cuda") is None  # dense: cuBLAS


@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads,expected", [
    (128, 32, 8, "triton.paged_attention"), (64, 9, 3, "triton.paged_attention"), (16, 4, 2, "triton.paged_attention"),
    (96, 32, 32, "triton.paged_attention"), (256, 8, 4, "triton.paged_attention"),
    (256, 4, 1, "triton.paged_attention"),
    (100, 32, 8, None), (512, 8, 8, None), (8, 4, 4, None), (128, 128, 1, None),
])
def test_registry_attention_support_by_head_dim_and_group(head_dim, num_heads, num_kv_heads, expected):
    q = KernelQuery("attention", "bfloat16", num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                    kv_dtype="bfloat16", kv_block_size=16)
    assert (select(q, "cuda").name if select(q, "cuda") else None) == expected


def test_registry_takes_the_family_attributes_the_kernels_compute():
    from optc.kernels.activation import ACTS

    attention = KernelQuery("attention", "bfloat16", num_heads=8, num_kv_heads=4, head_dim=256, kv_dtype="int8")
    for softcap, window in ((50.0, None), (None, 4096), (50.0, 512)):
        assert select(replace(attention, softcap=softcap, window=window), "cuda").name == "triton.paged_attention"
    assert select(replace(attention, window=0), "cuda") is None
    assert select(KernelQuery("gated_act", "bfloat16", act="gelu_tanh"), "cuda").name == "triton.gated_act"
    assert select(KernelQuery("gated_act", "bfloat16", act="relu"), "cuda") is None
    assert set(ACTS) == set(GATED_ACTS)
    for op in ("rope", "rope_kv_store"):
        rope = KernelQuery(op, "bfloat16", num_heads=24, num_kv_heads=8, head_dim=128, rotary_dim=96)
        assert select(rope, "cuda").name == f"triton.{op}"
        assert select(replace(rope, rotary_dim=95), "cuda") is None
        assert select(replace(rope, rotary_dim=130), "cuda") is None


def test_registry_rejects_unknown_dtype_and_hidden_size():
    assert select(KernelQuery("rms_norm", "float64", hidden_size=64), "cuda") is None
    assert select(KernelQuery("rms_norm", "float16", hidden_size=32768), "cuda") is None
    assert select(KernelQuery("rms_norm", "float16", hidden_size=4096), "cuda").name == "triton.rms_norm"
    assert select(KernelQuery("embedding", "float16"), "cuda") is None


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


def test_select_binds_only_kernels_of_the_asked_target():
    assert {k.target for k in KERNELS.values()} <= set(TARGETS)
    queries = [KernelQuery("linear", dtype, _int4(128), (4096, 4096)) for dtype in ("bfloat16", "float32")]
    queries += [KernelQuery("rms_norm", "bfloat16", hidden_size=4096), KernelQuery("gated_act", "float32")]
    for q in queries:
        assert select(q, "cuda").target == "cuda"
        assert select(q, "cpu") is None or select(q, "cpu").target == "cpu"
    # Triton is cuda's: the CPU's norm is its C++ one
    assert select(KernelQuery("rms_norm", "bfloat16", hidden_size=4096), "cpu").name == "cpu.cpp_rms_norm"


def test_prepared_impl_prepares_each_node_once_and_passes_the_prepared_params():
    from optc.core.ir import Node

    prepared, seen = [], []

    def prepare(params):
        prepared.append(params)
        return {"weight": f"packed {params['weight']}"}

    impl = PreparedImpl(lambda node, inputs, params, step: seen.append(params["weight"]) or [], prepare)
    a, b = (Node(n, "linear", ["x"], [f"{n}_out"], {}, {"weight": f"{n}.weight"}) for n in ("a", "b"))
    params_a, params_b = {"weight": "A"}, {"weight": "B"}
    for _ in range(3):
        impl(a, [None], params_a, None)
        impl(b, [None], params_b, None)
    assert prepared == [params_a, params_b]
    assert seen == ["packed A", "packed B"] * 3
    impl(a, [None], {"weight": "A2"}, None)  # new params (a reloaded model): prepared again
    assert len(prepared) == 3 and seen[-1] == "packed A2"


def test_every_kernel_calling_a_cpp_extension_names_its_loader():
    # a launcher in kernels/cpu_ext compiles its extension on first use unless the runtime compiled it at load
    for name, spec in KERNELS.items():
        assert (spec.extension is not None) == spec.launcher.startswith("cpu_ext."), name
        if spec.extension is not None:
            module, function = spec.extension.split(":")
            assert callable(getattr(importlib.import_module(f"optc.kernels.{module}"), function)), name


def test_loading_a_model_compiles_its_kernels_extensions_before_any_request(recipes, tmp_path, monkeypatch):
    from optc.core.artifact import read
    from optc.kernels.spec import KernelSpec
    from optc.runtime.loader import load_model
    from optc.testing import build_artifact

    artifact = read(build_artifact(tmp_path / "a", recipes / "tiny.yaml",
                                   "passes=[fuse_qkv, {select_kernels: {measure: false}}]"))
    bound = {n.kernel for n in artifact.graph.nodes} - {"torch"}
    assert {"cpu.cpp_attention", "cpu.cpp_rms_norm"} <= bound
    compiled = []
    monkeypatch.setattr(KernelSpec, "compile_extension", lambda self: compiled.append(self.name))
    load_model(artifact)
    assert sorted(compiled) == sorted(bound)
