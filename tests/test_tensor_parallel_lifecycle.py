"""Tensor-parallel engines that start and end within one test, on the CPU (gloo, 2 spawned ranks):
`optc run -tp 2`, and two `torchrun` launches as two machines would run it, give the tokens of one
rank; a model that does not split is a one-line error; and
a dead or hung rank is one clear error naming it within the collective timeout, after which the engine
stays failed and no process is left.

A module of its own: a process belongs to one tensor-parallel group at a time, and the engines of
test_tensor_parallel.py live until that module ends."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from optc.cli import app
from optc.runtime import Engine, SamplingParams
from optc.runtime.distributed import TensorParallelError
from optc.testing import assert_close, assert_two_nodes_give_one_rank_tokens

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_optc_run_tensor_parallel_gives_the_tokens_of_one_rank(tiny_artifact):
    run = lambda *extra: CliRunner().invoke(app, ["run", str(tiny_artifact), "--prompt", "hello there",
                                                  "--max-tokens", "6", "--json", *extra])
    one, two = run(), run("-tp", "2", "--distributed-backend", "gloo")
    assert one.exit_code == 0 and two.exit_code == 0, two.output
    assert json.loads(two.output.splitlines()[-1])["token_ids"] == json.loads(one.output.splitlines()[-1])["token_ids"]
    assert not multiprocessing.active_children()
    three = run("--tensor-parallel-size", "3")
    assert three.exit_code == 2
    assert three.output.strip().splitlines()[-1] == (
        "error: cannot split attention (4 query heads over 2 KV heads) 3 ways: 4 query heads do not split evenly; "
        "tensor-parallel sizes that work for this model: 1, 2, 4")


def test_two_torchrun_nodes_give_the_tokens_of_one_rank(tiny_artifact):
    """The multi-machine path (docs/PARALLEL.md) with both nodes on this machine."""
    torchrun = Path(sys.executable).parent / "torchrun"
    command = lambda rank, port: [str(torchrun), "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(rank),
                                  "--master-addr", "127.0.0.1", "--master-port", str(port), "--no-python",
                                  str(Path(sys.executable).parent / "optc"), "run", str(tiny_artifact), "--prompt",
                                  "hello there", "--max-tokens", "6", "--json", "-tp", "2"]
    assert_two_nodes_give_one_rank_tokens(tiny_artifact, command)


@pytest.mark.parametrize("fault", ["dead", "hung"])
def test_a_dead_or_hung_rank_is_one_clear_error(tiny_artifact, fault):
    engine = Engine.load(tiny_artifact, tensor_parallel_size=2, collective_timeout_s=3.0)
    worker = engine.runner.group.workers[0]
    assert engine.generate([PROMPTS[0]], PARAMS)[0].token_ids
    if fault == "dead":
        worker.kill()
        worker.join()
        expected = r"tensor-parallel rank 1 \(exit code -9\) died"
    else:
        os.kill(worker.pid, signal.SIGSTOP)
        expected = "timed out after 3 s"
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match=expected):
        engine.generate(PROMPTS[:3], PARAMS)
    assert time.monotonic() - start < 20
    with pytest.raises(TensorParallelError, match=expected):  # the engine stays failed
        engine.generate([PROMPTS[0]], PARAMS)
    engine.close()
    assert not worker.is_alive() and not multiprocessing.active_children()


def test_optc_bench_and_eval_tensor_parallel(tiny_artifact):
    """bench -tp 2 serves every token over 2 ranks; eval -tp 2 scores the split model like one rank."""
    invoke = lambda *args: CliRunner().invoke(app, [*args, "--json"])
    bench = invoke("bench", str(tiny_artifact), "-tp", "2", "--distributed-backend", "gloo", "--num-requests", "3",
                   "--input-len", "8", "--output-len", "4")
    assert bench.exit_code == 0, bench.output
    result = json.loads(bench.output[bench.output.index("{"):])
    assert (result["tensor_parallel_size"], result["num_output_tokens"]) == (2, 12)
    assert not multiprocessing.active_children()
    one, two = (invoke("eval", str(tiny_artifact), "--max-tokens", "1024", *extra) for extra in ([], ["-tp", "2"]))
    assert one.exit_code == 0 and two.exit_code == 0, two.output
    one, two = json.loads(one.output), json.loads(two.output)
    assert two["windows"] == one["windows"] == 2
    assert abs(two["ppl"] - one["ppl"]) < 1e-4 * one["ppl"]
    assert not multiprocessing.active_children()


def test_tensor_parallel_options_reject_bad_input(tiny_artifact):
    invoke = lambda *args: CliRunner().invoke(app, list(args))
    backend = invoke("bench", str(tiny_artifact), "-tp", "2", "--distributed-backend", "mpi")
    assert backend.exit_code == 2
    assert backend.output.strip().splitlines()[-1] == (
        "error: distributed backend (--distributed-backend) must be one of ['nccl', 'gloo'], got 'mpi'")
    url = invoke("bench", "--url", "http://127.0.0.1:1", "-tp", "2")
    assert url.exit_code == 2
    assert "--tensor-parallel-size is for in-process runs" in url.output
    source = invoke("eval", "random:tiny", "-tp", "2")
    assert source.exit_code == 2
    assert "--tensor-parallel-size 2 needs an artifact folder to split, got 'random:tiny'" in source.output
    zero = invoke("serve", str(tiny_artifact), "-tp", "0")
    assert zero.exit_code == 2 and "Invalid value for '--tensor-parallel-size'" in zero.output


def test_a_worker_that_dies_before_joining_is_an_error_not_a_hang(tiny_artifact):
    # a script piped into `python -`: spawned workers cannot re-import its main module and exit at once;
    # rank 0 must say so instead of waiting at the rendezvous (which has no deadline)
    script = ("from optc.runtime import Engine\n"
              f"Engine.load({str(tiny_artifact)!r}, tensor_parallel_size=2, distributed_backend='gloo')\n")
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "died while starting" in run.stderr, run.stderr[-2000:]
    assert time.monotonic() - start < 60


def _as_one_torchrun_rank(monkeypatch) -> None:
    """The environment torchrun gives the only process of `torchrun --nproc-per-node 1`."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)


def _one_rank_through_the_group(artifact, monkeypatch, device: str) -> None:
    """Under torchrun, N = 1 joins a group of one and runs its rank graph (collectives included): the
    tokens and logits (bitwise on the CPU) of the plain engine."""
    import torch
    import torch.distributed as dist

    prompts = [[(5 * i + j) % 200 + 1 for j in range(3 + 9 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    plain = Engine.load(artifact, device=device, num_blocks=64)
    want = [c.token_ids for c in plain.generate(prompts, params)]
    args = ([prompts[3]], [0], [[1, 2, 3]], [len(prompts[3])])
    want_logits = plain.runner.forward(*args).clone()
    _as_one_torchrun_rank(monkeypatch)
    engine = Engine.load(artifact, device=device, num_blocks=64)
    try:
        group = engine.runner.group
        assert group is not None and group.size == 1
        assert group.backend == ("nccl" if device == "cuda" else "gloo")
        ops = [n.op for n in engine.model.graph.nodes]
        assert "all_reduce" in ops and ops[-1] == "all_gather"
        assert [c.token_ids for c in engine.generate(prompts, params)] == want
        if device == "cuda":
            assert engine.runner.graph_runner is not None  # the decode steps replayed captured collectives
        got = engine.runner.forward(*args)
        if device == "cpu":
            assert torch.equal(got, want_logits)
        else:  # cuBLAS may pick another algorithm for a second engine's first call
            assert_close(got, want_logits, rtol=1e-5, what="logits through a group of one")
    finally:
        engine.close()
    assert not dist.is_initialized()


def test_one_torchrun_rank_runs_the_distributed_path(tiny_artifact, monkeypatch):
    _one_rank_through_the_group(tiny_artifact, monkeypatch, "cpu")


@pytest.mark.gpu
def test_one_torchrun_rank_runs_nccl_and_captures_its_collectives(tmp_path, monkeypatch):
    """The path N GPUs run, on one: NCCL collectives in the rank graph, captured into CUDA graphs."""
    import torch

    from optc.testing import build_artifact

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    recipe = tmp_path / "cuda.yaml"
    recipe.write_text("model: random:tiny\ndtype: float32\ntarget: cuda\npasses: [fuse_qkv, fuse_gate_up, kv_layout, "
                      "select_kernels, {cuda_graphs: {batch_sizes: [1, 2, 4]}}]\n"
                      "runtime: {max_num_seqs: 4, max_seq_len: 128}\n")
    _one_rank_through_the_group(build_artifact(tmp_path / "a", recipe), monkeypatch, "cuda")
