"""`optc serve -tp 2` and `-pp 2` as live processes on random:tiny (gloo, 2 ranks): the `openai` client gets
the tokens of one rank; killing the worker mid-request ends the server within 60 s with a non-zero exit
and a message naming the dead rank, and leaves none of its processes behind."""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

from optc.runtime import Engine, SamplingParams  # noqa: E402
from optc.testing import serve_process  # noqa: E402

PROMPT = "The quick brown fox"


@pytest.mark.parametrize("option", ["-tp", "-pp"])
def test_serve_over_2_ranks_answers_and_a_killed_worker_ends_the_server(tiny_artifact, option):
    want = Engine.load(tiny_artifact).generate([PROMPT], SamplingParams(max_tokens=8))[0].text
    with tempfile.TemporaryFile("w+") as log, serve_process(tiny_artifact, option, "2", "--distributed-backend",
                                                            "gloo", log=log) as (url, process):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=60, max_retries=0)
        answer = client.completions.create(model="a", prompt=PROMPT, max_tokens=8, temperature=0)
        assert answer.choices[0].text == want
        descendants = _descendants(process.pid)
        (worker,) = [pid for pid in descendants if _is_spawned(pid)]  # rank 1
        stream = client.completions.create(model="a", prompt=PROMPT, max_tokens=400, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        received = threading.Event()
        reader = threading.Thread(target=_read, args=(stream, received), daemon=True)
        reader.start()
        assert received.wait(60)  # the request is mid-generation
        os.kill(worker, signal.SIGKILL)
        start = time.monotonic()
        code = process.wait(60)
        assert time.monotonic() - start < 60
        reader.join(10)
        log.seek(0)
        output = log.read()
    assert code == 2, output
    kind = "tensor" if option == "-tp" else "pipeline"
    assert f"error: {kind}-parallel rank 1 (exit code -9) died" in output
    time.sleep(1)  # the kernel reaps orphans asynchronously
    assert [pid for pid in descendants if _is_running(pid)] == []


def _read(stream, received: threading.Event) -> None:
    try:
        for _ in stream:
            received.set()
    except openai.APIError:  # the server failed the request and closed the stream: expected
        pass


def _descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc's parent links."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _is_spawned(pid: int) -> bool:
    """A multiprocessing spawn child (the worker), not its resource tracker."""
    line = _cmdline(pid)
    return b"spawn_main" in line and b"resource_tracker" not in line


def _is_running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
