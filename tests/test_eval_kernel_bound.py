"""Quality scoring of a graph whose nodes are bound to Triton kernels runs every node through its op's
torch reference: `optc eval`, compare's quality column and `eval: true` on a `target: cuda` build."""

import json

import pytest

from optc.commands.compare.measure import measure_quality
from optc.commands.eval import evaluate
from optc.core.artifact import read
from optc.core.ir import REFERENCE_KERNEL
from optc.kernels.registry import KERNELS
from optc.testing import build_artifact

CUDA_PASSES = ("passes=[fuse_qkv, fuse_gate_up, kv_layout, fuse_add_rmsnorm, fuse_rope_kv, select_kernels, "
               "cuda_graphs]")


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("eval-text") / "t.txt"
    path.write_text("".join(chr(32 + (i * 7) % 90) for i in range(600)))
    return str(path)


@pytest.fixture(scope="module")
def builds(recipes, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kernel-bound")
    cuda = build_artifact(tmp / "cuda", recipes / "tiny.yaml", "target=cuda", CUDA_PASSES)
    cpu = build_artifact(tmp / "cpu", recipes / "tiny.yaml", "target=cpu", CUDA_PASSES)
    return cuda, cpu


def test_the_cuda_build_binds_triton_kernels(builds):
    cuda, cpu = builds
    assert {n.kernel for n in read(cuda).graph.nodes} - {REFERENCE_KERNEL}
    assert {KERNELS[k].target for k in {n.kernel for n in read(cpu).graph.nodes} - {REFERENCE_KERNEL}} <= {"cpu"}


def test_eval_scores_a_kernel_bound_graph_as_its_reference_graph(builds, text):
    cuda, cpu = builds
    bound = evaluate(cuda, cpu, data=text, max_tokens=512, window=128)
    assert bound["kld"] == pytest.approx(0.0, abs=1e-9) and bound["top1_agreement"] == 1.0
    assert bound["ppl"] == pytest.approx(evaluate(cpu, data=text, max_tokens=512, window=128)["ppl"])


def test_compare_quality_column_on_a_kernel_bound_graph(builds, text):
    cuda, cpu = builds
    rows = measure_quality({"cuda": cuda, "cpu": cpu}, cpu, text, 512, 128, show_progress=False)
    assert [r["nll"] for r in rows["cuda"]] == pytest.approx([r["nll"] for r in rows["cpu"]])
    assert all(r["kld"] == pytest.approx(0.0, abs=1e-9) for r in rows["cuda"])


def test_build_with_eval_on_a_cuda_target(recipes, tmp_path):
    out = build_artifact(tmp_path / "e", recipes / "tiny.yaml", "target=cuda", CUDA_PASSES, "eval=true")
    quality = json.loads((out / "manifest.json").read_text())["quality"]
    assert quality["kld"] == pytest.approx(0.0, abs=1e-9) and quality["top1_agreement"] == 1.0


def test_build_takes_the_evaluator_from_its_caller(recipes, tmp_path):
    """The build layer does not import `optc eval` (docs/ARCHITECTURE.md's layers): a library caller that asks
    for `eval: true` without an evaluator is told which one to pass, before anything is built; the one it
    passes is what the manifest records."""
    from optc.core.errors import UserError
    from optc.frontend.build import BuildOptions, build

    options = BuildOptions(recipe=recipes / "tiny.yaml", out=tmp_path / "e", overrides=("eval=true",), quiet=True)
    with pytest.raises(UserError, match=r"`eval: true` needs an evaluator.*evaluate=optc.commands.eval.evaluate_build"):
        build(options)
    assert not (tmp_path / "e").exists()
    calls = []
    out = build(options, evaluate=lambda graph, store, source: calls.append(source.record) or {"kld": 0.5})
    assert json.loads((out / "manifest.json").read_text())["quality"] == {"kld": 0.5} and len(calls) == 1
