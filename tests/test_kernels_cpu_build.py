"""kernels/cpu_ext's build lock: a build SIGKILLed mid-compile leaves nothing that holds up the next build (the
kernel drops its flock; cpp_extension's own `lock` file, which it left, is removed), and a build that finds the
lock held says whose it is, and gives up at its bound with an error naming the lock file and the holder, which
`build` logs and turns into None (the launchers' fallback).

The extension built is a tiny Python module in C++ without torch's headers (a second to compile), in a
temporary cache; the killed build compiles through a "compiler" that hangs, so the kill lands mid-compile."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from optc.kernels import cpu_ext

TINY = """\
// a Python module with no functions: compiles in about a second (no torch headers)
#include <Python.h>
#define OPTC_CAT(a, b) a##b
#define OPTC_INIT(name) OPTC_CAT(PyInit_, name)
#define OPTC_STR(x) #x
#define OPTC_NAME(x) OPTC_STR(x)
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, OPTC_NAME(TORCH_EXTENSION_NAME), nullptr, -1, nullptr};
PyMODINIT_FUNC OPTC_INIT(TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&module); }
"""
HANGING_CXX = """\
#!/bin/sh
# a compiler that marks that a compile began and then hangs in it until the mark is removed (ninja starts it in a
# process group of its own, which killing the build's group does not reach); anything else runs the real one
case " $* " in *" -c "*) touch "$0.started"; while [ -e "$0.started" ]; do sleep 0.2; done; exit 1;; esac
exec c++ "$@"
"""
BUILD = textwrap.dedent("""
    import sys
    from pathlib import Path
    from optc.kernels.cpu_ext import Extension, compile_extension
    ext = Extension("tiny", ("tiny.cpp",), ("-O0",), "nothing", folder=Path(sys.argv[1]))
    print(compile_extension(ext, Path(sys.argv[2])).__name__, flush=True)
""")
HOLD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from optc.kernels.cpu_ext import build_lock
    with build_lock(Path(sys.argv[1]), "tiny"):
        print("held", flush=True)
        time.sleep(600)
""")
NORMAL_BUILD_SECONDS = 90  # the tiny module builds in a few seconds even on a loaded 2-core machine


@pytest.fixture(autouse=True)
def _toolchain():
    if cpu_ext.missing_toolchain() is not None:
        pytest.skip(f"the C++ build lock NOT TESTED: {cpu_ext.missing_toolchain()}")


def _tiny(folder: Path) -> cpu_ext.Extension:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tiny.cpp").write_text(TINY)
    return cpu_ext.Extension("tiny", ("tiny.cpp",), ("-O0",), "nothing", folder=folder)


def _wait_for(path: Path, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear in {seconds} s"
        time.sleep(0.1)


def test_a_build_killed_mid_compile_holds_up_no_later_build(tmp_path):
    """The killed build leaves cpp_extension's `lock` behind (on which cpp_extension alone waits forever); the
    next process builds in normal time, and removes it."""
    ext, root = _tiny(tmp_path / "src"), tmp_path / "cache"
    hanging = tmp_path / "hanging-c++"
    hanging.write_text(HANGING_CXX)
    hanging.chmod(0o755)
    args = [sys.executable, "-c", BUILD, str(ext.folder), str(root)]
    first = subprocess.Popen(args, env={**os.environ, "CXX": str(hanging)}, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for(Path(f"{hanging}.started"), NORMAL_BUILD_SECONDS)
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # python and ninja: a killed `optc serve`'s group
        first.wait()
        Path(f"{hanging}.started").unlink(missing_ok=True)  # and the hung compiler ends itself
    where = ext.build_dir(root)
    assert (where / cpu_ext.TORCH_LOCK_FILE).exists() and not ext.is_built(root)

    start = time.monotonic()
    second = subprocess.run(args, capture_output=True, text=True, timeout=4 * NORMAL_BUILD_SECONDS)
    took = time.monotonic() - start
    assert second.returncode == 0, second.stderr[-3000:]
    assert second.stdout.split() == [f"optc_tiny_{ext.tag()}"]
    assert took < NORMAL_BUILD_SECONDS, f"the build after a killed one took {took:.0f} s"
    assert ext.is_built(root) and not (where / cpu_ext.TORCH_LOCK_FILE).exists()
    assert "waiting for" not in second.stderr  # the dead build's flock went with it


def test_a_waiter_names_the_holder_and_gives_up_at_its_bound(tmp_path, capfd, caplog):
    ext, root = _tiny(tmp_path / "src"), tmp_path / "cache"
    where = ext.build_dir(root)
    where.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(where)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        named = rf"pid {holder.pid} \(building tiny since \d{{4}}-\d\d-\d\dT\d\d:\d\d:\d\dZ\)"
        lock = re.escape(str(where / cpu_ext.LOCK_FILE))
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=rf"{lock} is still held by {named} after 1 s"):
            cpu_ext.compile_extension(ext, root, wait_seconds=1.0)
        assert 1.0 <= time.monotonic() - start < 10
        err = capfd.readouterr().err
        assert f"optc: waiting for pid {holder.pid} (building tiny since" in err and str(where) in err

        with caplog.at_level(logging.WARNING, logger="optc.kernels.cpu_ext"):
            assert cpu_ext.build(ext, root, wait_seconds=0.5) is None  # the launchers' fallback
        assert f"TimeoutError: {where / cpu_ext.LOCK_FILE} is still held by pid {holder.pid}" in caplog.text
        assert not ext.is_built(root)
    finally:
        holder.kill()
        holder.wait()
    module = cpu_ext.compile_extension(ext, root, wait_seconds=10.0)  # the holder's death released the lock
    assert module.__name__ == f"optc_tiny_{ext.tag()}" and ext.is_built(root)
    assert f'"pid": {os.getpid()}' in (where / cpu_ext.LOCK_FILE).read_text()  # the last holder: this process
