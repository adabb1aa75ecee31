"""`optc warmup` (optc/commands/warmup.py), run as a user runs it, each in its own process and cache: the extension
built once reports cached the second time; without a compiler it is skipped, saying why, and the exit code is 0; a
compiler that fails makes a failed line with its error and exit code 1."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from optc.kernels import cpu_ext
from optc.testing import cpu_extension

OPTC = Path(sys.executable).with_name("optc")  # the console script installed beside this interpreter
FAILING_CXX = """\
#!/bin/sh
# a compiler whose every compile fails; anything else (its version, the link) runs the real one
case " $* " in *" -c "*) echo "failing-c++: error: this compiler refuses" >&2; exit 1;; esac
exec c++ "$@"
"""


def _warmup(*args: str, cache: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(OPTC), "warmup", *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OPTC_CACHE": str(cache), **env})


def test_the_extension_built_once_is_cached_the_second_time(tmp_path):
    """The first warmup in a cache holding the compiled objects but no library links it (built), the second finds
    it (cached). The objects are the suite's build, copied, so that the test links instead of compiling."""
    built = cpu_ext.CPU.build_dir(cpu_ext.cache_root())
    cpu_extension()  # skips where this machine cannot build it, fails where it should and does not
    folder = cpu_ext.CPU.build_dir(tmp_path / "cpu_ext")
    shutil.copytree(built, folder, ignore=shutil.ignore_patterns("*.so", cpu_ext.LOCK_FILE, cpu_ext.TORCH_LOCK_FILE))
    first = _warmup(cache=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    name, status, seconds, unit, where = first.stdout.split()
    assert (name, status, unit, where) == ("cpu", "built", "s", str(folder)) and float(seconds) > 0
    second = _warmup("--json", cache=tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    outcome = json.loads(second.stdout)
    assert (outcome["name"], outcome["status"], outcome["detail"]) == ("cpu", "cached", str(folder))


def test_without_a_compiler_the_extension_is_skipped_saying_why(tmp_path):
    out = _warmup(cache=tmp_path, CXX=str(tmp_path / "no-such-c++"))
    assert out.returncode == 0, out.stderr[-3000:]
    words = out.stdout.split()
    assert words[:5] == ["cpu", "skipped", "0.0", "s", "no"] and "C++ compiler" in out.stdout


def test_a_failed_build_is_a_failed_line_and_exit_1(tmp_path):
    if cpu_ext.missing_toolchain() is not None:
        pytest.skip(f"optc warmup's failures NOT TESTED: {cpu_ext.missing_toolchain()}")
    if cpu_ext.lacks_avx2():
        pytest.skip("optc warmup's failures NOT TESTED: torch runs this CPU without AVX2")
    failing = tmp_path / "failing-c++"
    failing.write_text(FAILING_CXX)
    failing.chmod(0o755)
    out = _warmup(cache=tmp_path, CXX=str(failing))
    assert out.returncode == 1, out.stderr[-3000:]
    (line,) = out.stdout.splitlines()
    assert line.split()[:2] == ["cpu", "failed"] and "error: this compiler refuses" in line


def test_help_explains_every_option():
    from typer.testing import CliRunner

    from optc.cli import app

    result = CliRunner().invoke(app, ["warmup", "--help"], terminal_width=200)
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    for needle in ("--json", "$OPTC_CACHE/cpu_ext", "built, cached, failed", "skipped", "Exit 1"):
        assert needle in text, needle
