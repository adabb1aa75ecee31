"""The copy-bandwidth yardstick (benchmarks/yardstick.py) on the CPU: its arithmetic, its choice among sizes,
benchmarks/kernels.py's table labelling the method, the copy kernel under the Triton interpreter, and compiled
for sm_90."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from optc.testing import benchmark_module

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    return benchmark_module("yardstick"), benchmark_module("kernels")


def test_a_copy_moves_its_bytes_twice_and_gbps_is_bytes_over_time(bench):
    y, _ = bench
    assert y.copy_bytes(1 << 30) == 2 << 30
    assert y.gbps(4.3e9, 1.0) == pytest.approx(4300.0)  # 4.3 GB in 1 ms
    assert y.gbps(y.copy_bytes(1 << 30), 0.5) == pytest.approx(2 * 2**30 / 0.5e-3 / 1e9)
    assert y.fraction_of(2580.0, 4300.0) == pytest.approx(0.6)
    with pytest.raises(ValueError, match="positive, got 0 ms"):
        y.gbps(1, 0)
    with pytest.raises(ValueError, match="yardstick must be positive"):
        y.fraction_of(1.0, 0.0)


def test_the_yardstick_is_the_fastest_size_and_says_how_it_was_measured(bench):
    y, _ = bench
    # 256 MiB in 0.14 ms, 1 GiB in 0.5 ms, 2 GiB in 1.02 ms: the 1 GiB copy moves the most per second
    stick = y.from_times({256 << 20: 0.14, 1 << 30: 0.5, 2 << 30: 1.02})
    assert stick.nbytes == 1 << 30 and stick.gbps == pytest.approx(2 * 2**30 / 0.5e-3 / 1e9)
    assert stick.by_size[256 << 20] == pytest.approx(2 * 2**28 / 0.14e-3 / 1e9)
    assert stick.method == y.METHOD and "no graph" in stick.method
    assert stick.label() == f"{stick.gbps:.0f} GB/s ({y.METHOD}, best of 256 MiB/1 GiB/2 GiB)"
    with pytest.raises(ValueError, match="no copy was timed"):
        y.from_times({})


def test_the_h200_finding_in_numbers(bench):
    """The issue's arithmetic: a kernel at 60% of a 4,300 GB/s copy read as 95% of the 2,716 GB/s graph memcpy."""
    y, _ = bench
    kernel = 0.6 * 4300.0
    assert y.fraction_of(kernel, 2716.0) / y.fraction_of(kernel, 4300.0) == pytest.approx(4300 / 2716)
    assert 1.55 < 4300 / 2716 < 1.6


def test_kernels_table_names_the_yardstick_and_keeps_the_old_column(bench):
    _, k = bench
    row = {"device": "H", "copy_gbps": 4300.0, "copy_method": "m", "graph_memcpy_gbps": 2716.0, "kernel": "w4a16.qkv",
           "shape": "M=1", "bytes": 2.58e6, "triton_us": 1.0, "triton_gbps": 2580.0, "fraction_of_copy": 0.6,
           "fraction_of_graph_memcpy": 2580 / 2716, "torch_us": 2.0, "torch_gbps": 1290.0, "speedup": 2.0,
           "max_rel_err": 1e-3}
    lines = k.kernels_table([row]).splitlines()
    assert lines[0] == "device: H; copy bandwidth: 4300 GB/s (m); CUDA-graph memcpy: 2716 GB/s"
    assert "%copy" in lines[1] and "%memcpy" in lines[1]
    assert lines[2].split()[5:7] == ["60.0%", "95.0%"]
    new_keys = ("copy_method", "graph_memcpy_gbps", "fraction_of_graph_memcpy")
    old = {key: v for key, v in row.items() if key not in new_keys}  # a row from before the yardstick
    head = k.kernels_table([old]).splitlines()[0]
    assert head == "device: H; copy bandwidth: 4300 GB/s (a copy_, method not recorded)"


@pytest.mark.parametrize("n", [1, 8191, 8192, 3 * 8192 + 5])
def test_copy_kernel_copies_every_element(bench, n):
    y, _ = bench
    g = torch.Generator().manual_seed(n)
    src = torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, generator=g)
    dst = torch.full((n,), -7, dtype=torch.int32)  # poisoned: an unwritten element shows
    assert y.copy(src, dst) is dst and torch.equal(dst, src)
    with pytest.raises(AssertionError, match="src torch.int32 x 5 != dst torch.int64 x 5"):
        y.copy(src.new_zeros(5), torch.empty(5, dtype=torch.int64))


def test_copy_kernel_compiles_for_sm90_to_16_byte_copies():
    """Compiled for an H100/H200 without a GPU (in a process of its own: TRITON_INTERPRET unset): eight 16-byte
    loads per thread and no spills, so the yardstick is a copy at the width the kernels it judges aim for."""
    script = textwrap.dedent("""
        import json, torch, yardstick
        from optc.kernels.compile_only import compile_only
        with compile_only(90, True) as launches:
            yardstick.copy(torch.empty(1 << 20, dtype=torch.int32), torch.empty(1 << 20, dtype=torch.int32))
        print(json.dumps([[c.spill_bytes, c.loads] for launch in launches for c in launch.configs]))
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=BENCH, capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == [[0, {"16": 8}]]
