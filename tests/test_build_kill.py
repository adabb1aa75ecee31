"""A build killed (SIGKILL) at random moments, many times over, into the same output folder with --force:
after each kill the folder is either absent or a whole artifact byte-identical to an uninterrupted build,
and the only things beside it are killed builds' temporaries, which the next build to reach its write
removes; the build that is finally let run produces the same bytes and leaves nothing else.

Seeded: the kill moments are the same on every run. OPTC_KILL_BUILDS=100 kills more builds (default 12).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from optc.core.artifact import read

NUM_KILLS = int(os.environ.get("OPTC_KILL_BUILDS", "12"))
SEED = 32

# Imports everything first, says "ready", waits for a line on stdin, then builds: the kill lands in the
# build (load, passes, write, rename), not in Python's start-up.
BUILDER = '''
import sys, time
from pathlib import Path
from optc.commands.eval import evaluate_build
from optc.frontend.build import BuildOptions, build
import optc.frontend.sources, optc.passes.fuse_qkv, optc.passes.fuse_gate_up, transformers, safetensors.torch
print("ready", flush=True)
sys.stdin.readline()
t0 = time.perf_counter()
build(BuildOptions(recipe=Path(sys.argv[1]), out=Path(sys.argv[2]), force=True, quiet=True), evaluate=evaluate_build)
print(f"built {time.perf_counter() - t0:.3f}", flush=True)
'''


def _start(recipe: Path, out: Path) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", BUILDER, str(recipe), str(out)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "ready"
    return process


def _go(process: subprocess.Popen) -> None:
    process.stdin.write("go\n")
    process.stdin.flush()


def _contents(folder: Path) -> dict[str, bytes]:
    """Every file's bytes but report.json's (timings: not deterministic)."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != "report.json"}


def test_builds_killed_at_random_moments_leave_nothing_half_written(recipes, tmp_path):
    recipe, parent = recipes / "tiny.yaml", tmp_path / "builds"
    reference = parent / "reference"
    first = _start(recipe, reference)
    _go(first)
    out, _ = first.communicate(timeout=120)
    assert first.returncode == 0, out
    seconds = float(out.split()[-1])
    expected = _contents(reference)
    read(reference)

    target = parent / "a"
    rng = random.Random(SEED)
    process = _start(recipe, target)
    outcomes, killed = [], set()
    for i in range(NUM_KILLS):
        following = _start(recipe, target)  # its imports overlap this round (the 2-core CI has time to spare)
        # half the kills anywhere in the build, half in its last fifth: the write and the rename into place
        delay = rng.uniform(0, seconds * 1.1) if i % 2 == 0 else rng.uniform(seconds * 0.8, seconds * 1.05)
        _go(process)
        time.sleep(delay)
        process.send_signal(signal.SIGKILL)
        process.wait(30)
        outcomes.append("finished" if process.returncode == 0 else "killed")
        if target.exists():  # whole, never half: the same bytes as the uninterrupted build
            assert _contents(target) == expected, f"kill {i} after {delay:.3f} s left a different artifact"
            read(target)
        killed.add(process.pid)
        leftovers = sorted(p.name for p in parent.iterdir())  # until a later build reaches its write: the killed
        allowed = {f".a.{kind}-{pid}" for pid in killed for kind in ("tmp", "old")}  # builds' temporaries
        assert set(leftovers) - {"reference", "a"} <= allowed, f"kill {i} after {delay:.3f} s left {leftovers}"
        process = following
    assert outcomes.count("killed") >= NUM_KILLS // 2, outcomes  # the kills landed inside builds

    _go(process)  # the next build removes the last temporary and writes the same artifact
    out, _ = process.communicate(timeout=120)
    assert process.returncode == 0, out
    assert sorted(p.name for p in parent.iterdir()) == ["a", "reference"]
    assert _contents(target) == expected
    read(target)
