"""Pipeline-parallel engines that start and end within one test, on the CPU (gloo): a dead stage is one
clear error naming it within the collective timeout, after which the engine stays failed and no process
is left; `optc inspect -pp` shows the stages, `optc bench -pp 2` runs over 2 ranks, `optc eval -pp 2`
scores as one rank, and sizes that do not fit are one-line errors; optc's own
--nnodes/--node-rank/--master-addr/--master-port start the ranks of two "machines" (both on this one)
and give one rank's tokens.

A module of its own: a process belongs to one group at a time, and the engines of
test_pipeline_parallel.py live until that module ends."""

from __future__ import annotations

import json
import multiprocessing
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from optc.cli import app
from optc.runtime import Engine, SamplingParams
from optc.runtime.distributed import TensorParallelError
from optc.testing import assert_two_nodes_give_one_rank_tokens

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_a_dead_stage_is_one_clear_error_and_leaves_no_process(tiny_pp_artifact):
    engine = Engine.load(tiny_pp_artifact, pipeline_parallel_size=2, collective_timeout_s=3.0)
    worker = engine.runner.group.workers[0]  # rank 1: the last stage
    assert engine.generate([PROMPTS[0]], PARAMS)[0].token_ids
    worker.kill()
    worker.join()
    start = time.monotonic()
    expected = r"pipeline-parallel rank 1 \(exit code -9\) died"
    with pytest.raises(TensorParallelError, match=expected):
        engine.generate(PROMPTS[:3], PARAMS)
    assert time.monotonic() - start < 20
    with pytest.raises(TensorParallelError, match=expected):  # the engine stays failed
        engine.generate([PROMPTS[0]], PARAMS)
    engine.close()
    assert not multiprocessing.active_children()


def test_inspect_bench_and_eval_take_pp_and_bad_sizes_are_errors(tiny_pp_artifact):
    invoke = lambda *args: CliRunner().invoke(app, list(args))
    shown = invoke("inspect", str(tiny_pp_artifact), "-pp", "2", "--json")
    assert shown.exit_code == 0, shown.output
    assert [s["layers"] for s in json.loads(shown.output)["pipeline_parallel"]["stages"]] == [[0, 2], [2, 4]]
    five = invoke("run", str(tiny_pp_artifact), "--prompt", "hi", "-pp", "5")
    assert five.exit_code == 2 and "cannot cut 4 layers into 5 pipeline stages" in five.output
    bench = invoke("bench", str(tiny_pp_artifact), "-pp", "2", "--num-requests", "2", "--output-len", "3", "--json")
    assert bench.exit_code == 0, bench.output
    assert json.loads(bench.output[bench.output.index("{"):])["pipeline_parallel_size"] == 2
    one, two = (invoke("eval", str(tiny_pp_artifact), "--max-tokens", "1024", "--json", *extra)
                for extra in ([], ["-pp", "2"]))
    assert one.exit_code == 0 and two.exit_code == 0, two.output
    assert abs(json.loads(two.output)["ppl"] - json.loads(one.output)["ppl"]) < 1e-4 * json.loads(one.output)["ppl"]
    assert not multiprocessing.active_children()
    nodes = invoke("run", str(tiny_pp_artifact), "--prompt", "hi", "-pp", "3", "--nnodes", "2", "--master-addr", "x",
                   "--master-port", "1")
    assert nodes.exit_code == 2 and "--nnodes 2 does not divide the 3 ranks" in nodes.output


def test_two_nodes_started_by_optc_give_the_tokens_of_one_rank(tiny_pp_artifact):
    """--nnodes 2 --node-rank 0|1 --master-addr --master-port, as two machines run it, both on this one."""
    command = lambda rank, port: [str(Path(sys.executable).parent / "optc"), "run", str(tiny_pp_artifact), "--prompt",
                                  "hello there", "--max-tokens", "6", "--json", "-pp", "2", "--nnodes", "2",
                                  "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port)]
    assert_two_nodes_give_one_rank_tokens(tiny_pp_artifact, command)
