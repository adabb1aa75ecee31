"""A CPU build and a CPU run never import triton: the op references live in optc.core.ops, and only the
kernels of a `target: cuda` artifact need it."""

import json
import subprocess
import sys

CODE = """
import json, sys
from optc.cli import app
recipe, out = sys.argv[1], sys.argv[2]
app(["build", recipe, "--out", out, "--quiet"], standalone_mode=False)
app(["run", out, "--prompt", "hello", "--max-tokens", "4", "--json"], standalone_mode=False)
print(json.dumps({"triton_imported": "triton" in sys.modules}))
"""


def test_cpu_build_and_run_import_no_triton(recipes, tmp_path):
    # a fresh interpreter: this test process has imported triton for the kernel tests
    done = subprocess.run([sys.executable, "-c", CODE, str(recipes / "tiny.yaml"), str(tmp_path / "tiny")],
                          capture_output=True, text=True, check=True)
    run, verdict = (json.loads(line) for line in done.stdout.strip().splitlines()[-2:])
    assert run["completion_tokens"] == 4  # the engine generated
    assert verdict == {"triton_imported": False}
