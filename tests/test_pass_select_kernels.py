"""select_kernels: bindings on a hand-built graph for cuda and cpu, fallbacks, idempotence, the cpu
choice per M bucket (measured; its routing at run time; shapes a kernel cannot run), and logits of
random:tiny with Triton kernels bound (interpreter on the CPU) against the references."""

import torch

from optc.core.execute import Executor, bind_params, run_dense
from optc.core.formats import Format, FormatKind
from optc.core.ir import Graph, ModelConfig, Node, TensorInfo
from optc.frontend.passmanager import PassContext, make_pass
from optc.frontend.sources import load_source
from optc.kernels.registry import impls


def _graph(head_dim: int = 16) -> Graph:
    config = ModelConfig("LlamaForCausalLM", hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                         num_kv_heads=2, head_dim=head_dim, vocab_size=256, rms_norm_eps=1e-5,
                         rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=False,
                         dtype="bfloat16")
    heads = {"num_heads": 4, "num_kv_heads": 2, "head_dim": head_dim}
    int4 = Format(FormatKind.INT4_G, dtype="bfloat16", bits=4, group_size=32, packing="k8_lsb")
    nodes = [
        Node("embed", "embedding", ["input_ids"], ["h0"], {}, {"weight": "embed.weight"}),
        Node("norm", "rms_norm", ["h0"], ["x"], {"eps": 1e-5}, {"weight": "norm.weight"}),
        Node("qkv", "linear", ["x"], ["q", "k", "v"], {"in_features": 64, "out_features": 128, "split": [64, 32, 32]},
             {"weight": "qkv.weight"}),
        Node("rope", "rope", ["q", "k", "positions"], ["q_rot", "k_rot"], dict(heads)),
        Node("attention", "attention", ["q_rot", "k_rot", "v"], ["attn"],
             {"layer": 0, **heads, "scale": 0.25, "kv_block_size": 16, "kv_dtype": "bfloat16"}),
        Node("o", "linear", ["attn"], ["o"], {"in_features": 64, "out_features": 64}, {"weight": "o.weight"}),
        Node("lm_head", "lm_head", ["o"], ["logits"], {}, {"weight": "head.weight"}),
    ]
    dense = Format(dtype="bfloat16")
    tensors = {"embed.weight": TensorInfo((256, 64), dense), "norm.weight": TensorInfo((64,), dense),
               "qkv.weight": TensorInfo((128, 64), int4), "o.weight": TensorInfo((64, 64), dense),
               "head.weight": TensorInfo((256, 64), dense)}
    return Graph(config, nodes, tensors)


def _kernels(graph: Graph) -> dict[str, str]:
    return {n.name: n.attrs["kernel"] for n in graph.nodes}


def test_select_kernels_binds_triton_on_cuda_and_torch_elsewhere():
    graph = _graph()
    cuda = make_pass("select_kernels").run(graph, None, PassContext(target="cuda"))
    assert cuda.changed
    assert _kernels(cuda.graph) == {"embed": "torch", "norm": "triton.rms_norm", "qkv": "triton.w4a16",
                                    "rope": "triton.rope", "attention": "triton.paged_attention",
                                    "o": "torch", "lm_head": "torch"}  # dense linears stay on cuBLAS
    assert cuda.stats["kernels"]["torch"] == 3
    cpu = make_pass("select_kernels", {"measure": False}).run(graph, None, PassContext(target="cpu"))
    on_cpu = {"qkv": "cpu.int4pack", "norm": "cpu.cpp_rms_norm", "attention": "cpu.cpp_attention",
              "o": "cpu.bf16dot", "lm_head": "cpu.bf16dot_logits"}  # dense bfloat16 on the C++ dot
    assert _kernels(cpu.graph) == {n.name: on_cpu.get(n.name, "torch") for n in graph.nodes}
    assert "kernel" not in graph.nodes[0].attrs  # the input graph is untouched


def test_select_kernels_falls_back_on_unsupported_shapes_and_disabled_kernels():
    odd = make_pass("select_kernels").run(_graph(head_dim=20), None, PassContext(target="cuda"))
    assert _kernels(odd.graph)["attention"] == "torch" and _kernels(odd.graph)["rope"] == "triton.rope"
    off = make_pass("select_kernels", {"disable": ("triton.w4a16",)}).run(_graph(), None, PassContext(target="cuda"))
    assert _kernels(off.graph)["qkv"] == "torch" and _kernels(off.graph)["norm"] == "triton.rms_norm"


def test_select_kernels_is_idempotent():
    p = make_pass("select_kernels")
    once = p.run(_graph(), None, PassContext(target="cuda"))
    twice = p.run(once.graph, None, PassContext(target="cuda"))
    assert not twice.changed and twice.graph.to_json() == once.graph.to_json()


def test_select_kernels_triton_logits_match_reference_on_random_tiny():
    # fp32 model: kernels and references differ only by summation order
    src = load_source("random:tiny")
    graph, store = src.graph, src.store
    for name, options in [("fuse_qkv", {}), ("fuse_gate_up", {}), ("fuse_add_rmsnorm", {}), ("fuse_rope_kv", {})]:
        r = make_pass(name, options).run(graph, store, PassContext())
        graph, store = r.graph, r.store
    bound = make_pass("select_kernels").run(graph, store, PassContext(target="cuda")).graph
    names = {n.attrs["kernel"] for n in bound.nodes} - {"torch"}
    assert names == {"triton.rms_norm", "triton.add_rms_norm", "triton.rope_kv_store", "triton.paged_attention",
                     "triton.gated_act"}
    ids = torch.randint(0, 256, (2, 21), generator=torch.Generator().manual_seed(3))
    ref = run_dense(Executor(graph, bind_params(graph, store)), ids)
    out = run_dense(Executor(bound, bind_params(bound, store), impls(names)), ids)
    diff = (out - ref).abs()
    assert diff.max() < 1e-4, f"max diff {diff.max():.3g}, mean diff {diff.mean():.3g}"


def test_min_cuda_capability_is_the_floor_raised_by_the_bound_kernels():
    from dataclasses import replace

    from optc.core.artifact import MIN_CUDA_CAPABILITY
    from optc.frontend.build import min_cuda_capability
    from optc.kernels.registry import KERNELS

    cuda = make_pass("select_kernels").run(_graph(), None, PassContext(target="cuda")).graph
    assert min_cuda_capability(cuda) == MIN_CUDA_CAPABILITY == (8, 0)
    hopper = {**KERNELS, "triton.w4a16": replace(KERNELS["triton.w4a16"], min_capability=(9, 0))}
    assert min_cuda_capability(cuda, hopper) == (9, 0)  # qkv is bound to w4a16
    off = make_pass("select_kernels", {"disable": ("triton.w4a16",)}).run(_graph(), None, PassContext(target="cuda"))
    assert min_cuda_capability(off.graph, hopper) == (8, 0)


def test_cpu_choice_is_measured_per_m_bucket_and_a_second_run_keeps_it():
    from optc.kernels.choose import M_BUCKETS

    dense_off = {"disable": ("cpu.bf16dot", "cpu.bf16dot_logits")}  # o and lm_head: tests/test_kernels_bf16dot.py
    once = make_pass("select_kernels", dense_off).run(_graph(), None, PassContext(target="cpu"))
    qkv = next(n for n in once.graph.nodes if n.name == "qkv")
    table = qkv.attrs.get("kernel_by_m", [[None, qkv.kernel]])
    # increasing bounds from the buckets, the last open; neighbours differ; `kernel` names one of them
    assert [b for b, _ in table][-1] is None and all(b in M_BUCKETS for b, _ in table[:-1])
    assert all(a[1] != b[1] for a, b in zip(table, table[1:], strict=False))
    assert {k for _, k in table} <= {"cpu.int4pack", "cpu.qdot", "torch"}
    assert qkv.kernel == next((k for _, k in table if k != "torch"), "torch")
    # the other nodes: no weight to measure, the first supporting kernel (the C++ ops) or the reference
    assert all(n.kernel in ("torch", f"cpu.cpp_{n.op}") and "kernel_by_m" not in n.attrs
               for n in once.graph.nodes if n.name != "qkv")
    (measured,) = once.stats["measured_us"].values()  # one shape measured, every bucket, both candidates
    assert sorted(measured) == list(M_BUCKETS) and all(set(t) == {"cpu.int4pack", "cpu.qdot", "torch"}
                                                       for t in measured.values())
    twice = make_pass("select_kernels", dense_off).run(once.graph, None, PassContext(target="cpu"))
    assert not twice.changed and twice.graph.to_json() == once.graph.to_json()


def test_kernel_by_m_routes_each_call_by_its_rows():
    # random:tiny bf16 int4: small M on cpu.int4pack, larger M on the reference, exactly as each alone
    src = load_source("random:tiny")
    ctx = PassContext(target="cpu", dtype="bfloat16")
    graph, store = src.graph, src.store
    for name, options in (("cast", {"dtype": "bfloat16"}), ("quantize_rtn", {"bits": 4, "group_size": 32})):
        r = make_pass(name, options).run(graph, store, ctx)
        graph, store = r.graph, r.store
    kernel = make_pass("select_kernels", {"measure": False}).run(graph, store, ctx).graph
    reference = make_pass("select_kernels", {"disable": ("cpu.int4pack", "cpu.qdot")}).run(graph, store, ctx).graph
    routed = kernel.copy()
    routed.nodes = [Node(n.name, n.op, n.inputs, n.outputs,
                         {**n.attrs, "kernel_by_m": [[2, "cpu.int4pack"], [None, "torch"]]}
                         if n.kernel == "cpu.int4pack" else n.attrs, n.params) for n in kernel.nodes]
    params = bind_params(graph, store)
    graphs = {"kernel": kernel, "reference": reference, "routed": routed}
    bound = impls({n.kernel for g in graphs.values() for n in g.nodes} - {"torch"})  # int4pack, the C++ ops
    run = {name: Executor(g, params, bound) for name, g in graphs.items()}
    for rows, expect, other in ((2, "kernel", "reference"), (6, "reference", "kernel")):
        ids = torch.randint(0, 256, (1, rows), generator=torch.Generator().manual_seed(rows))
        out = run_dense(run["routed"], ids)
        assert torch.equal(out, run_dense(run[expect], ids))
        assert not torch.equal(out, run_dense(run[other], ids))  # the two paths round differently


def test_a_kernel_bound_to_a_shape_it_cannot_run_is_a_build_error():
    import pytest

    from optc.core.errors import UserError
    from optc.kernels.choose import Chooser
    from optc.kernels.registry import KERNELS, KernelQuery

    graph = make_pass("select_kernels", {"measure": False}).run(_graph(), None, PassContext(target="cpu")).graph
    qkv = next(i for i, n in enumerate(graph.nodes) if n.name == "qkv")
    n = graph.nodes[qkv]  # 128 x 64 int4: move it onto the int8 kernel, which reads int8_wo only
    graph.nodes[qkv] = Node(n.name, n.op, n.inputs, n.outputs, {**n.attrs, "kernel": "cpu.int8pack"}, n.params)
    with pytest.raises(UserError, match=r"node qkv \(linear, weight \[128, 64\] int4_g, bfloat16\) is bound to "
                                        r"kernel cpu\.int8pack"):
        make_pass("select_kernels").ensures(graph)
    # a kernel whose predicate lets through a shape it then refuses fails while measured, with the same names
    from dataclasses import replace

    lax = replace(KERNELS["cpu.int8pack"], supports=lambda q: True)
    fmt = Format(FormatKind.INT8_WO, dtype="bfloat16", bits=8)
    node = Node("o", "linear", ["attn"], ["o"], {"in_features": 100, "out_features": 48}, {"weight": "o.weight"})
    with pytest.raises(UserError, match=r"kernel cpu\.int8pack cannot run node o \(linear, weight \[48, 100\] "
                                        r"int8_wo, x \(1, 100\) bfloat16\)"):
        Chooser().choose(node, KernelQuery("linear", "bfloat16", fmt, (48, 100)), [lax])


def _family_graph(rotary_dim: int = 12) -> Graph:
    """_graph with Gemma 2's and Phi-4-mini's attributes on its nodes: a soft-capped sliding attention,
    partial rotary and a GeGLU."""
    graph = _graph()
    nodes = []
    for n in graph.nodes:
        attrs = dict(n.attrs)
        if n.op == "attention":
            attrs |= {"softcap": 50.0, "window": 12}
        if n.op == "rope":
            attrs |= {"rotary_dim": rotary_dim}
        nodes.append(Node(n.name, n.op, n.inputs, n.outputs, attrs, n.params))
    nodes.insert(3, Node("act", "gated_act", ["x", "x"], ["y"], {"act": "gelu_tanh"}))
    return Graph(graph.config, nodes, graph.tensors)


def test_family_attributes_bind_the_triton_kernels():
    graph = make_pass("select_kernels").run(_family_graph(), None, PassContext(target="cuda")).graph
    kernels = _kernels(graph)
    assert (kernels["attention"], kernels["rope"], kernels["act"]) == (
        "triton.paged_attention", "triton.rope", "triton.gated_act")
    # an odd rotary width (no rotate-half pairs) is refused: the node keeps its reference
    graph = make_pass("select_kernels").run(_family_graph(rotary_dim=11), None, PassContext(target="cuda")).graph
    assert _kernels(graph)["rope"] == "torch"


def _rebound(graph: Graph, name: str, kernel: str) -> Graph:
    """`graph` through select_kernels, then node `name` bound to `kernel`."""
    graph = make_pass("select_kernels").run(graph, None, PassContext(target="cuda")).graph
    graph.nodes = [Node(n.name, n.op, n.inputs, n.outputs, {**n.attrs, "kernel": kernel}, n.params) if n.name == name
                   else n for n in graph.nodes]
    return graph


def test_a_kernel_bound_to_an_attribute_it_cannot_take_names_node_attribute_and_remedy(monkeypatch):
    from dataclasses import replace

    import pytest

    from optc.core.errors import UserError
    from optc.kernels import registry

    remedy = (r"rebuild with select_kernels after every pass that changes the node \(it leaves a node no kernel "
              r"takes on its torch reference\), or disable the kernel "
              r"\(select_kernels: \{disable: \[triton\.rope\]\}\)")
    graph = _rebound(_family_graph(rotary_dim=11), "rope", "triton.rope")
    with pytest.raises(UserError, match=r"node rope \(rope, hidden 64, head_dim 16, bfloat16\) is bound to kernel "
                                        r"triton\.rope, which cannot take its attribute rotary_dim=11 "
                                        r"\(LlamaForCausalLM\): " + remedy):
        make_pass("select_kernels").ensures(graph)
    # a kernel that refused windows (as triton.paged_attention did before it computed them) names the window
    spec = registry.KERNELS["triton.paged_attention"]
    graph = _rebound(_family_graph(), "attention", spec.name)
    monkeypatch.setitem(registry.KERNELS, spec.name,
                        replace(spec, supports=lambda q: spec.supports(q) and q.window is None))
    with pytest.raises(UserError, match=r"node attention \(attention, .*\) is bound to kernel "
                                        r"triton\.paged_attention, which cannot take its attribute window=12"):
        make_pass("select_kernels").ensures(graph)
    # a shape no kernel runs (head dim 512) says so, with the same remedy
    graph = _rebound(_graph(head_dim=512), "attention", spec.name)
    with pytest.raises(UserError, match=r"node attention \(attention, hidden 64, head_dim 512, bfloat16\) is bound "
                                        r"to kernel triton\.paged_attention, which cannot run that shape: rebuild"):
        make_pass("select_kernels").ensures(graph)


def test_inspect_shows_the_choice_per_m_and_the_packed_layout(tmp_path):
    from optc.commands.inspect import render, summarize
    from optc.testing import build_artifact

    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: random:tiny\ndtype: bfloat16\ntarget: cpu\npasses:\n  - fuse_qkv\n"
                      "  - quantize_rtn: {bits: 4, group_size: 32}\n  - select_kernels\n")
    s = summarize(build_artifact(tmp_path / "a", recipe))
    measured = next(p for p in s["passes"] if p["name"] == "select_kernels")["stats"]["measured_us"]
    assert set(measured["linear 128x64 int4_g/g32 bfloat16"]) == {"1", "8", "32", "128", "512"}  # JSON keys
    bound = {n for n, k in s["kernels"].items() if k in ("cpu.int4pack", "cpu.qdot", "cpu.bf16dot_logits")}
    assert set(s["kernel_by_m"]) <= bound
    qkv = "model.layers.0.self_attn.qkv_proj"
    s["kernels"][qkv] = "cpu.int4pack"
    s["kernel_by_m"] = {qkv: [[1, "cpu.int4pack"], [128, "torch"], [None, "cpu.int4pack"]]}
    s["kernel_layouts"] = {"cpu.int4pack": "int4pack_cpu(inner_k_tiles=2)"}
    text = render(s)
    assert "qkv_proj" in text and "M<=1 cpu.int4pack, M<=128 torch, M>128 cpu.int4pack" in text
    assert "cpu.int4pack repacks its weights at load into int4pack_cpu(inner_k_tiles=2)" in text
    assert "linear 128x64 int4_g/g32 bfloat16 (µs, 1 thread) M=1: cpu.int4pack" in text


def test_timing_spends_its_rounds_on_the_contenders(monkeypatch):
    """After the first rounds a candidate 100x slower than the fastest is not timed again, so the budget goes to
    the close ones: their every call is counted, the slow one's only MIN_ROUNDS."""
    import pytest

    from optc.kernels import choose

    clock = {"t": 0.0}
    cost = {"fast": 0.002, "close": 0.003, "slow": 0.3}
    counts = dict.fromkeys(cost, 0)

    def call(name):
        counts[name] += 1
        clock["t"] += cost[name]

    monkeypatch.setattr(choose.time, "perf_counter", lambda: clock["t"])
    best = choose.time_interleaved({n: (lambda n=n: call(n)) for n in cost})
    assert best == pytest.approx(cost)
    assert counts["slow"] == choose.MIN_ROUNDS
    assert counts["fast"] == counts["close"] == choose.MAX_ROUNDS
