"""A GPU stage's first check (benchmarks/gpu_session.sh): the packages optc needs are importable, and
the versions and Triton features the stage relies on. Exits 1 at once, naming every missing package
(the device machine has no network: a missing package must be carried as a wheel). With a GPU it also
prints the device's copy bandwidth the way benchmarks/kernels.py measures its yardstick
(benchmarks/yardstick.py), so every stage's log names the bandwidth its numbers are read against."""

from __future__ import annotations

import importlib.util
import inspect
import sys

NEEDED = ("torch", "triton", "transformers", "safetensors", "tokenizers", "typer", "yaml", "tqdm", "accelerate",
          "pytest", "pytest_timeout")


def main() -> int:
    missing = [name for name in NEEDED if importlib.util.find_spec(name) is None]
    if missing:
        print(f"missing Python packages: {', '.join(missing)} (no network on the device machine: carry them as "
              "wheels, /work/.library/device/README.md)", file=sys.stderr)
        return 1
    import torch
    import transformers
    import triton

    params = inspect.signature(triton.autotune).parameters
    print(f"torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}; "
          f"triton.autotune takes cache_results: {'cache_results' in params}, do_bench: {'do_bench' in params}")
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        print(f"{p.name}: {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB")
        import yardstick  # benchmarks/, beside this script

        print(f"copy bandwidth: {yardstick.measure().label()}")
    else:
        print("no CUDA device")
    return 0


if __name__ == "__main__":
    sys.exit(main())
