"""Every Triton kernel compiles for sm_90 (H100) on a machine without a GPU, and fits it.

The interpreter tests check what the kernels compute; these check what only the compiler sees:
tile shapes it refuses, registers spilled, shared memory past the per-block limit. They run
`benchmarks/kernels.py --compile-only` (and small scripts) in processes of their own, because the
kernel modules must be imported with TRITON_INTERPRET unset. Nothing here runs a kernel.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from optc.kernels import w4a16, w4a16_tiles, w8a16

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "kernels.py"
FAMILIES = {"_w4a16_kernel", "_w8a16_kernel", "_decode_kernel", "_combine_kernel", "_prefill_kernel",
            "_rms_norm_kernel", "_rope_kv_store_kernel", "_gated_act_kernel", "_reduce_kernel", "_w4a16_tiles_kernel"}
TILES_CONFIGS = w4a16_tiles.M1_CONFIGS + w4a16_tiles.DECODE_CONFIGS + w4a16_tiles.PREFILL_CONFIGS


def _env():
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_DEFAULT_FP_FUSION": "1"}


def _compile_report(tmp_path, *args):
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--compile-only", "--json", str(out), *args],
                          capture_output=True, text=True, env=_env(), timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


def _tiles(report, kernel):
    return {(c["config"]["BLOCK_M"], c["config"]["BLOCK_N"], c["config"]["BLOCK_K"], c["config"]["num_warps"],
             c["config"]["num_stages"]) for c in report["compiled"] if c["kernel"] == kernel}


def _config_tiles(configs):
    return {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps, c.num_stages) for c in configs}


def test_kernels_compile_sm90_every_autotune_config_bf16_without_spills(tmp_path):
    report = _compile_report(tmp_path, "--all-configs", "--dtypes", "bfloat16")
    assert {c["kernel"] for c in report["compiled"]} == FAMILIES
    # every config of the quantized linears' autotune lists was compiled (group 128 prunes none) ...
    for module, kernel in ((w4a16, "_w4a16_kernel"), (w8a16, "_w8a16_kernel")):
        assert _tiles(report, kernel) == _config_tiles(module.M1_CONFIGS + module.GEMV_CONFIGS + module.GEMM_CONFIGS)
    # ... and none of them, nor any other kernel, spills registers or overflows shared memory
    bad = [(c["kernel"], c["config"], c["spill_bytes"], c["shared_bytes"])
           for c in report["compiled"] if c["spill_bytes"] or not c["fits"]]
    assert not bad
    # the quantized weights stream in wide copies: with K tiles of 64 or more, no 4-byte loads (a
    # w4a16 that gathered one word per nibble compiled to 4-byte cp.async only)
    narrow = [(c["kernel"], c["config"], c["loads"]) for c in report["compiled"]
              if c["kernel"] in ("_w4a16_kernel", "_w8a16_kernel") and c["config"]["BLOCK_K"] >= 64
              and ("4" in c["loads"] or "16" not in c["loads"])]
    assert not narrow
    # the n8_tiles kernel: every config, and 16-byte loads carry most of what each program text loads (the codes;
    # the rest is x and one 4-byte scale/zero word per row and group)
    tiles = [c for c in report["compiled"] if c["kernel"] == "_w4a16_tiles_kernel"]
    keys = ("BLOCK_M", "BLOCK_N", "BLOCK_K")
    assert {(*(c["config"][k] for k in keys), c["config"]["num_warps"], c["config"]["num_stages"]) for c in tiles} == {
        (*(c.kwargs[k] for k in keys), c.num_warps, c.num_stages) for c in TILES_CONFIGS}
    assert not [(c["config"], c["loads"]) for c in tiles if _wide_share(c["loads"]) < 0.7]


def _wide_share(loads: dict) -> float:
    """The share of the bytes of a program's global-load instructions that 16-byte instructions load."""
    return int(loads.get("16", 0)) * 16 / sum(int(w) * n for w, n in loads.items())


def test_kernels_compile_sm90_fp16_fp32(tmp_path):
    # fp32 (exact products, no tensor cores) is for parity runs: it may spill, but must compile and fit
    report = _compile_report(tmp_path, "--dtypes", "float16,float32")
    assert {c["kernel"] for c in report["compiled"]} == FAMILIES
    assert not [c for c in report["compiled"] if c["dtype"] == "float16" and c["spill_bytes"]]


def test_kernels_compile_sm90_smollm2_shapes(tmp_path):
    # head_dim 64, 9 query heads over 3 KV heads, hidden 576, int4 groups of 64
    report = _compile_report(tmp_path, "--model", "smollm2-135m", "--dtypes", "bfloat16,float16")
    assert {c["kernel"] for c in report["compiled"]} == FAMILIES
    assert not [c for c in report["compiled"] if c["spill_bytes"]]
    # the int8 / fp8 KV variants (store quantizes, attention reads scales) compiled for both dtypes
    scaled = {(c["kernel"], c["dtype"]) for c in report["compiled"] if c["config"].get("HAS_SCALES")}
    assert scaled == {(k, d) for k in ("_rope_kv_store_kernel", "_decode_kernel", "_prefill_kernel")
                      for d in ("bfloat16", "float16")}


# each family's real shapes (benchmarks/kernels.py MODELS): attention's padded head dim, whether its scores are
# soft-capped, whether it has sliding layers (then it compiles windowed and global attention), the gated
# activation (0 silu, 1 gelu_tanh), the norms' offset, rope's padded head dim
FAMILY_SHAPES = {
    "qwen3-0.6b": (128, False, False, 0, False, 128),
    "gemma-2-2b": (256, True, True, 1, True, 256),
    "gemma-3-270m": (256, False, True, 1, True, 256),
    "phi-3-mini": (128, False, False, 0, False, 128),  # head dim 96, padded
    "phi-4-mini": (128, False, False, 0, False, 128),  # 96 of 128 rotate
}


@pytest.mark.parametrize("model", list(FAMILY_SHAPES))
def test_kernels_compile_sm90_family_shapes(tmp_path, model):
    # bf16: every kernel, without spills
    compiled = _compile_report(tmp_path, "--model", model, "--dtypes", "bfloat16")["compiled"]
    assert {c["kernel"] for c in compiled} == FAMILIES
    assert not [(c["kernel"], c["config"]) for c in compiled if c["spill_bytes"] or not c["fits"]]
    block_d, softcap, sliding, act, offset, rope_d = FAMILY_SHAPES[model]
    attention = [c["config"] for c in compiled if c["kernel"] in ("_decode_kernel", "_prefill_kernel")]
    assert {(c["BLOCK_D"], c["SOFTCAP"]) for c in attention} == {(block_d, softcap)}
    assert {c["WINDOW"] for c in attention} == ({False, True} if sliding else {False})
    assert {c["config"]["ACT"] for c in compiled if c["kernel"] == "_gated_act_kernel"} == {act}
    assert {c["config"]["HAS_OFFSET"] for c in compiled if c["kernel"] == "_rms_norm_kernel"} == {offset}
    assert {c["config"]["BLOCK_D"] for c in compiled if c["kernel"] == "_rope_kv_store_kernel"} == {rope_d}


def test_kernels_compile_sm90_head_dim_256_attention_in_fp32_fits(tmp_path):
    # fp32 (parity runs) at Gemma 2's shapes: the largest attention tiles (prefill 136 KB of shared memory)
    # spill, but compile and fit; the sliding layers' rows only (the global ones share their tiles, and
    # the int8 / fp8 variants, spilling more, take ptxas half a minute more)
    report = _compile_report(tmp_path, "--model", "gemma-2-2b", "--dtypes", "float32",
                             "--only", "paged_decode.local,paged_prefill.local")
    compiled = report["compiled"]
    assert {c["kernel"] for c in compiled} == {"_decode_kernel", "_combine_kernel", "_prefill_kernel"}
    assert all(c["fits"] for c in compiled) and {c["config"]["BLOCK_D"] for c in compiled} == {256}


def test_compile_only_reports_what_the_interpreter_accepts(tmp_path):
    # a plain Python helper called from a kernel runs under the interpreter; the compiler refuses it
    script = tmp_path / "check.py"
    script.write_text(textwrap.dedent('''
        import sys
        import torch
        import triton
        import triton.language as tl
        from optc.kernels.compile_only import compile_only

        def twice(x):
            return x * 2

        @triton.jit
        def scale(a_ptr, out_ptr, B: tl.constexpr):
            offs = tl.arange(0, B)
            tl.store(out_ptr + offs, tl.load(a_ptr + offs) * 2)

        @triton.jit
        def scale_by_helper(a_ptr, out_ptr, B: tl.constexpr):
            offs = tl.arange(0, B)
            tl.store(out_ptr + offs, twice(tl.load(a_ptr + offs)))

        a = torch.randn(64)
        out = torch.empty_like(a)
        if triton.knobs.runtime.interpret:
            scale_by_helper[(1,)](a, out, B=64)
            assert torch.equal(out, 2 * a)
            sys.exit(0)
        with compile_only(90) as launches:
            scale[(1,)](a, out, B=64)
        (launch,) = launches
        (compiled,) = launch.configs
        assert launch.fits and compiled.registers > 0 and compiled.config["B"] == 64, launch
        with compile_only(90):
            try:
                scale_by_helper[(1,)](a, out, B=64)
            except Exception as exc:
                print("refused:", str(exc).splitlines()[-1])
                sys.exit(0)
        sys.exit("compiled a call of a plain Python function")
    '''))
    interpreted = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                                 env=_env() | {"TRITON_INTERPRET": "1"})
    assert interpreted.returncode == 0, interpreted.stdout + interpreted.stderr
    compiled = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=_env(), timeout=300)
    assert compiled.returncode == 0, compiled.stdout + compiled.stderr
    assert "refused: Unsupported function referenced" in compiled.stdout


def test_lora_bgmv_compiles_for_sm90_without_spills(tmp_path):
    # the runtime's LoRA launches on CUDA (runtime/lora.py FACTOR_DTYPES: bfloat16 rows on bfloat16 factors, float16
    # and float32 rows on float32 ones), ranks whose BLOCK_R runs from 8 to the largest allowed (64), at
    # Llama-3-8B's q/k/v split of a fused qkv output
    script = tmp_path / "bgmv.py"
    script.write_text(textwrap.dedent('''
        import json
        import torch
        from optc.kernels.compile_only import compile_only
        from optc.kernels.lora_bgmv import lora_add

        t, k, slots = 4, 4096, 4
        rows = []
        pairs = ((torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32), (torch.float32, torch.float32))
        for dtype, factors in pairs:
            for r in (8, 16, 64):
                x = torch.randn(t, k, dtype=dtype)
                out = torch.zeros(t, 4096 + 2 * 1024, dtype=dtype)
                outs = list(out.split([4096, 1024, 1024], dim=1))
                a = torch.randn(slots, r, k, dtype=factors)
                bt = torch.randn(slots, r, out.shape[1], dtype=factors)
                with compile_only(90) as launches:
                    lora_add(x, outs, torch.tensor([0, -1, 2, 3]), a, bt)
                for launch in launches:
                    for c in launch.configs:
                        rows.append({"dtype": str(dtype), "rank": r, "kernel": c.name, "fits": c.fits,
                                     "registers": c.registers, "spill_bytes": c.spill_bytes})
        print(json.dumps(rows))
    '''))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {(r["dtype"], r["rank"]) for r in rows} == {(d, r) for d in ("torch.bfloat16", "torch.float16",
                                                                       "torch.float32") for r in (8, 16, 64)}
    assert {r["kernel"] for r in rows} == {"_shrink", "_expand"}
    assert all(r["fits"] and 0 < r["registers"] <= 255 and r["spill_bytes"] == 0 for r in rows), rows
