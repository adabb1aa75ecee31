"""`optc warmup` (optc/commands/warmup.py), run as a user runs it, each in its own process and cache: an extension
built once reports cached the second time; without a compiler every extension is skipped, saying why, and the
exit code is 0; a compiler that fails makes a failed line with its error and exit code 1; an unknown name is a
user error (exit 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from optc.kernels import cpu_ext

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


def _lines(out: subprocess.CompletedProcess) -> dict[str, list[str]]:
    return {line.split()[0]: line.split()[1:] for line in out.stdout.splitlines()}


def test_an_extension_built_once_is_cached_the_second_time(tmp_path):
    if cpu_ext.missing_toolchain() is not None:
        pytest.skip(f"optc warmup's builds NOT TESTED: {cpu_ext.missing_toolchain()}")
    first = _warmup("--only", "bf16dot", cache=tmp_path)  # the quickest of the four to compile
    assert first.returncode == 0, first.stderr[-3000:]
    folder = str(cpu_ext.BF16DOT.build_dir(tmp_path / "cpu_ext"))
    status, seconds, unit, where = _lines(first)["bf16dot"]
    assert (status, unit, where) == ("built", "s", folder) and float(seconds) > 0
    second = _warmup("--only", "bf16dot", "--json", cache=tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    (outcome,) = json.loads(second.stdout)
    assert (outcome["name"], outcome["status"], outcome["detail"]) == ("bf16dot", "cached", folder)


def test_without_a_compiler_every_extension_is_skipped_saying_why(tmp_path):
    out = _warmup(cache=tmp_path, CXX=str(tmp_path / "no-such-c++"))
    assert out.returncode == 0, out.stderr[-3000:]
    lines = _lines(out)
    assert list(lines) == ["qdot", "bf16dot", "ops", "lora", "step"]
    for words in lines.values():
        assert words[:4] == ["skipped", "0.0", "s", "no"] and "C++ compiler" in " ".join(words)


def test_a_failed_build_is_a_failed_line_and_exit_1(tmp_path):
    if cpu_ext.missing_toolchain() is not None:
        pytest.skip(f"optc warmup's failures NOT TESTED: {cpu_ext.missing_toolchain()}")
    failing = tmp_path / "failing-c++"
    failing.write_text(FAILING_CXX)
    failing.chmod(0o755)
    out = _warmup("--only", "qdot", cache=tmp_path, CXX=str(failing))
    assert out.returncode == 1, out.stderr[-3000:]
    (line,) = out.stdout.splitlines()
    assert line.split()[:2] == ["qdot", "failed"] and "error: this compiler refuses" in line


def test_an_unknown_extension_is_a_user_error(tmp_path):
    out = _warmup("--only", "qdot", "--only", "nope", cache=tmp_path)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip() == ("error: --only nope: not a C++ CPU kernel extension (known: qdot, bf16dot, ops, "
                                  "lora, step)")


def test_help_explains_every_option():
    from typer.testing import CliRunner

    from optc.cli import app

    result = CliRunner().invoke(app, ["warmup", "--help"], terminal_width=200)
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    for needle in ("--only", "--json", "qdot", "bf16dot", "ops", "step", "$OPTC_CACHE/cpu_ext", "Exit 1"):
        assert needle in text, needle
