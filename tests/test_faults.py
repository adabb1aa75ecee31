"""Faults while serving: a kernel that raises mid-step (injected through the kernel table), and an artifact
whose weights file is truncated or replaced while it is being loaded.

A failed engine step answers the requests in flight with a 500 naming what failed, frees their KV blocks
and the server serves on; a second failure within --failure-window stops it with exit status 1.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")

from optc.core.artifact import ArtifactError  # noqa: E402
from optc.runtime import Engine, SamplingParams  # noqa: E402
from optc.testing import build_artifact, serve_process  # noqa: E402

INT8_KERNELS = "passes=[fuse_qkv, fuse_gate_up, {quantize_rtn: {bits: 8}}, {select_kernels: {measure: false}}]"

# Runs `optc` with the kernel table's cpu.int8pack replaced by one that raises while the file named by
# OPTC_TEST_FAIL_FILE exists: a failing kernel, through the table's own API (KERNELS, KernelSpec.bind).
FAILING_KERNEL_SCRIPT = '''
import dataclasses, os, sys
from optc.kernels import registry

TRIGGER = os.environ["OPTC_TEST_FAIL_FILE"]
real = registry.KERNELS["cpu.int8pack"]


class FailingKernel(registry.KernelSpec):
    def bind(self):
        impl = real.bind()

        def run(node, inputs, params, step):
            if os.path.exists(TRIGGER):
                raise RuntimeError(f"injected failure in kernel {self.name} at node {node.name}")
            return impl(node, inputs, params, step)

        return run


registry.KERNELS["cpu.int8pack"] = FailingKernel(**{f.name: getattr(real, f.name) for f in dataclasses.fields(real)})
from optc.cli import app

app(sys.argv[1:], prog_name="optc")
'''


@pytest.fixture(scope="module")
def int8_artifact(recipes, tmp_path_factory) -> Path:
    return build_artifact(tmp_path_factory.mktemp("int8-kernels") / "a", recipes / "tiny.yaml", INT8_KERNELS)


def metrics(url: str) -> dict[str, float]:
    wanted = ("optc:num_requests_running", "optc:kv_cache_usage_perc")
    return {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in httpx.get(f"{url}/metrics").text.splitlines()
            if line.startswith(wanted)}


def wait_for(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_failing_kernel_fails_the_requests_in_flight_then_the_server_serves_on_then_exits(int8_artifact, tmp_path):
    from optc.core.artifact import read

    assert "cpu.int8pack" in {n.kernel for n in read(int8_artifact).graph.nodes}  # the kernel the script replaces
    script, trigger, log_path = tmp_path / "serve.py", tmp_path / "fail-now", tmp_path / "serve.log"
    script.write_text(FAILING_KERNEL_SCRIPT)
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0}
    long_body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 480, "ignore_eos": True, "temperature": 0}
    with open(log_path, "w+") as log, serve_process(
            int8_artifact, "--served-model-name", "tiny", "--failure-window", "300", log=log,
            command=[sys.executable, str(script)], env={"OPTC_TEST_FAIL_FILE": str(trigger)}) as (url, process):
        before = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert before.status_code == 200
        answers: list[httpx.Response] = []
        threads = [threading.Thread(target=lambda: answers.append(
            httpx.post(f"{url}/v1/completions", json=long_body, timeout=60))) for _ in range(3)]
        for t in threads:
            t.start()
        wait_for(lambda: metrics(url)["optc:num_requests_running"] == 3, "3 requests in flight")
        trigger.touch()
        for t in threads:
            t.join(60)
        assert [a.status_code for a in answers] == [500] * 3, [a.text for a in answers]
        message = answers[0].json()["error"]["message"]
        assert "the engine step failed (RuntimeError: injected failure in kernel cpu.int8pack at node" in message
        trigger.unlink()
        wait_for(lambda: metrics(url) == {"optc:num_requests_running": 0, "optc:kv_cache_usage_perc": 0},
                 "every KV block back in the pool")
        again = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert again.status_code == 200 and again.json()["choices"] == before.json()["choices"]
        trigger.touch()  # a second failure within the window: the server stops rather than fail every request
        last = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert last.status_code == 500 and "injected failure" in last.json()["error"]["message"]
        assert process.wait(30) == 1
        log.seek(0)
        output = log.read()
    assert "a second engine step failed" in output and "window: 300 s" in output, output[-2000:]


def test_failure_window_must_be_positive():
    from optc.core.errors import InputError
    from optc.runtime.server import ServeOptions

    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(InputError, match="--failure-window must be a positive finite number"):
            ServeOptions(Path("x"), failure_window=bad)


@pytest.fixture
def copy_of(tiny_artifact, tmp_path):
    out = tmp_path / "a"
    shutil.copytree(tiny_artifact, out)
    return out


def _during_the_first_read(monkeypatch, change) -> None:
    """Run `change(weights file)` just before the loader reads its first tensor: another process writing
    the artifact while a server loads it."""
    import optc.core.store as store

    real, done = store._read, []

    def read(path: str, key: str):
        if not done:
            done.append(path)
            change(Path(path))
        return real(path, key)

    monkeypatch.setattr(store, "_read", read)


def test_weights_truncated_while_loading_are_a_named_load_error(copy_of, monkeypatch):
    _during_the_first_read(monkeypatch, lambda f: os.truncate(f, f.stat().st_size // 2))
    with pytest.raises(ArtifactError, match=r"weights-00001-of-00001.safetensors \(\d+ -> \d+ bytes\) changed "
                                            r"while the artifact was being loaded; reading it failed with"):
        Engine.load(copy_of)


def test_weights_replaced_while_loading_are_a_named_load_error(copy_of, monkeypatch):
    def replace(f: Path) -> None:  # same size and header, other values: it would load as another model
        data = bytearray(f.read_bytes())
        data[-64:] = bytes(64)
        f.with_suffix(".new").write_bytes(data)
        os.replace(f.with_suffix(".new"), f)

    _during_the_first_read(monkeypatch, replace)
    with pytest.raises(ArtifactError, match=r"weights-00001-of-00001.safetensors \(rewritten or replaced\) changed "
                                            r"while the artifact was being loaded: load it again"):
        Engine.load(copy_of)


def test_an_unchanged_artifact_loads(copy_of):
    engine = Engine.load(copy_of)
    assert engine.generate(["hi"], SamplingParams(max_tokens=2))[0].token_ids


def test_serve_of_a_truncated_artifact_exits_2_naming_the_file(copy_of):
    from typer.testing import CliRunner

    from optc.cli import app

    weights = next(copy_of.glob("weights-*.safetensors"))
    os.truncate(weights, 100)
    result = CliRunner().invoke(app, ["serve", str(copy_of), "--port", "0", "--no-verify"])
    assert result.exit_code == 2 and weights.name in result.output and "truncated" in result.output, result.output
