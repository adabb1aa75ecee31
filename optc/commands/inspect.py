"""`optc inspect`: a summary of an artifact from its manifest and graph, without loading weights."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from optc.core.artifact import read
from optc.core.kv_cache import KVCacheSpec, kv_cache_groups


def summarize(path: str | Path, tensor_parallel_size: int | None = None, pipeline_parallel_size: int | None = None,
              ) -> dict:
    """The artifact at `path` (sizes checked, hashes not: inspect reads no weights) as plain data; with
    `tensor_parallel_size`, how each split tensor shards and the weight bytes each rank holds; with
    `pipeline_parallel_size`, the stages: each one's layers, weight bytes and the values it receives and sends."""
    artifact = read(path, verify=False)
    m, graph = artifact.manifest.to_json(), artifact.graph
    formats = Counter(info.format.label for info in graph.tensors.values())
    weight_bytes = sum(f["bytes"] for n, f in m["files"].items() if n.startswith("weights-"))
    return {
        "path": str(artifact.path),
        "source": m["source"],
        "recipe": m["recipe"],
        "recipe_sha256": m["recipe_sha256"],
        "passes": m["passes"],
        "model": m["model"],
        "quantization": m.get("quantization"),
        "kv_layout": m.get("kv_layout"),
        "kv_bytes_per_token": KVCacheSpec.from_json(m["kv_layout"]).bytes_per_token(graph.config),
        "kv_cache_groups": [g.to_json() for g in kv_cache_groups(graph.config)],
        "target": m["target"],
        "toolchain": m["toolchain"],
        "quality": m.get("quality"),
        "formats": dict(sorted(formats.items())),
        "weight_bytes": weight_bytes,
        "total_bytes": sum(f["bytes"] for f in m["files"].values()),
        "moe": _moe(graph.config),
        "mla": _mla(graph.config),
        "num_nodes": len(graph.nodes),
        "ops": dict(sorted(Counter(n.op for n in graph.nodes).items())),
        "kernels": {n.name: n.kernel for n in graph.nodes},
        "kernel_by_m": {n.name: n.attrs["kernel_by_m"] for n in graph.nodes if n.attrs.get("kernel_by_m")},
        "kernel_layouts": _layouts({n.kernel for n in graph.nodes}
                                   | {k for n in graph.nodes for _, k in n.attrs.get("kernel_by_m", ())}),
        "kernel_candidates": {n.name: n.attrs["kernel_candidates"] for n in graph.nodes
                              if n.attrs.get("kernel_candidates")},
        "kernel_choice_cache": _cached_choices(graph),
        "cpu_step": _cpu_step(graph),
        **({"tensor_parallel": tensor_parallel(graph, tensor_parallel_size)} if tensor_parallel_size else {}),
        **({"pipeline_parallel": pipeline_parallel(graph, pipeline_parallel_size)} if pipeline_parallel_size else {}),
    }


def pipeline_parallel(graph, size: int) -> dict:
    """The stages the runtime cuts (optc/core/ops/stages.py); a StageError when the model has fewer layers."""
    from optc.core.ops.stages import plan_stages

    return {"size": size, "stages": [{"layers": list(s.layers), "weight_bytes": s.weight_bytes,
                                      "receives": list(s.receives), "sends": list(s.sends)}
                                     for s in plan_stages(graph, size)]}


def tensor_parallel(graph, size: int) -> dict:
    """Per rank: weight bytes, and the slice (axis, ranges) of every tensor it holds a part of; a
    ShardError when the model does not split `size` ways."""
    from optc.core.ops.sharding import plan_shards, rank_weight_bytes

    plans = [plan_shards(graph, rank, size) for rank in range(size)]
    return {
        "size": size,
        "rank_weight_bytes": [rank_weight_bytes(p.graph) for p in plans],
        "slices": {name: [{"axis": p.slices[name][0], "ranges": [list(r) for r in p.slices[name][1]],
                           **({"experts": True} if len(graph.tensors[name].shape) == 3 else {})} for p in plans]
                   for name in plans[0].slices},
    }


def render(s: dict) -> str:
    src = s["source"]
    model = s["model"]
    lines = [
        f"artifact   {s['path']}",
        f"source     {src.get('kind')}: {src.get('path') or src.get('id')}",
        f"model      {model['architecture']}, {model['num_layers']} layers, hidden {model['hidden_size']}, "
        f"{model['num_heads']} q heads / {model['num_kv_heads']} kv heads, vocab {model['vocab_size']}",
        f"target     {s['target']['device']}   dtype {s['recipe']['dtype']}   kv {s['kv_layout']}",
        f"kv cache   {s['kv_bytes_per_token']:.0f} bytes per token over {model['num_layers']} layers"
        + (" (scales included)" if s["kv_layout"].get("scales", "none") != "none" else ""),
        *([f"kv groups  {_groups(s['kv_cache_groups'])}"] if len(s.get("kv_cache_groups", ())) > 1 else []),
        *([f"moe        {s['moe']['num_experts']} experts of intermediate {s['moe']['moe_intermediate_size']}, "
           f"top-{s['moe']['top_k']}{' renormalized' if s['moe']['norm_topk_prob'] else ''}, in layers "
           f"{_ranges(s['moe']['moe_layers'])}" + (f" (dense MLP: {_ranges(s['moe']['dense_layers'])})"
                                                    if s['moe']['dense_layers'] else "") + _routing(s["moe"])]
          if s.get("moe") else []),
        *([f"mla        latent {s['mla']['kv_lora_rank']} + rope key {s['mla']['qk_rope_head_dim']} values per token "
           f"per layer, one copy for all heads (an MHA cache of these heads: {s['mla']['mha_values']}); q_lora_rank "
           f"{s['mla']['q_lora_rank'] or 'none'}, qk_nope {s['mla']['qk_nope_head_dim']}, v {s['mla']['v_head_dim']}"]
          if s.get("mla") else []),
        f"size       weights {s['weight_bytes'] / 2**20:.1f} MiB, total {s['total_bytes'] / 2**20:.1f} MiB",
        f"formats    {', '.join(f'{k} x{v}' for k, v in s['formats'].items())}",
        f"quant      {s['quantization'] or 'none'}",
        f"quality    {s['quality'] or 'not measured'}",
        "passes",
    ]
    for p in s["passes"]:
        stats = ", ".join(f"{k}={v}" for k, v in p["stats"].items() if not isinstance(v, dict | list))
        lines.append(f"  {p['name']:<18} {'changed' if p['changed'] else 'no change':<10} {stats}")
        for shape, buckets in p["stats"].get("measured_us", {}).items():  # select_kernels on cpu
            times = "; ".join(f"M={m}: " + " ".join(f"{k} {us:g}" for k, us in t.items()) for m, t in buckets.items())
            lines.append(f"    {shape} (µs, 1 thread) {times}")
    lines.append(f"ops        {', '.join(f'{k} x{v}' for k, v in s['ops'].items())}")
    kernels = Counter(s["kernels"].values())
    lines.append(f"kernels    {', '.join(f'{k} x{v}' for k, v in sorted(kernels.items()))}")
    for k, layout in s.get("kernel_layouts", {}).items():
        lines.append(f"  {k} repacks its weights at load into {layout} (the artifact keeps the format's parts)")
    by_m, candidates = s.get("kernel_by_m", {}), s.get("kernel_candidates", {})
    for name, k in s["kernels"].items():
        refined = (f" (default; measured per M at the first load on a GPU among {', '.join(candidates[name])})"
                   if name in candidates else "")
        lines.append(f"  {name:<48} {_by_m(by_m[name]) if name in by_m else k}{refined}")
    for shape, devices in s.get("kernel_choice_cache", {}).items():
        for device, table in devices.items():
            lines.append(f"  measured on {device}: {shape}: {_by_m(table)}")
    lines += _render_cpu_step(s.get("cpu_step"), s["num_nodes"])
    tp = s.get("tensor_parallel")
    if tp:
        per_rank = ", ".join(f"{b / 2**20:.2f}" for b in tp["rank_weight_bytes"])
        lines.append(f"tensor parallel {tp['size']} ranks: weights per rank (MiB) {per_rank}; other tensors whole")
        for name, slices in tp["slices"].items():
            axis = ("rows", "columns")[slices[0]["axis"] - slices[0].get("experts", False)]
            axis = f"expert {axis}" if slices[0].get("experts") else axis
            ranks = " | ".join(",".join(f"{a}:{b}" for a, b in rank["ranges"]) for rank in slices)
            lines.append(f"  {name:<48} {axis:<8} {ranks}")
    pp = s.get("pipeline_parallel")
    if pp:
        lines.append(f"pipeline parallel {pp['size']} stages (layers balanced by weight bytes)")
        for i, stage in enumerate(pp["stages"]):
            first, stop = stage["layers"]
            layers = f"layers {first}-{stop - 1}" if stop - first > 1 else f"layer {first}"
            lines.append(f"  stage {i}: {layers}, weights {stage['weight_bytes'] / 2**20:.2f} MiB, "
                         f"receives {', '.join(stage['receives']) or 'the ids'}, sends {', '.join(stage['sends'])}")
    return "\n".join(lines)


def _cpu_step(graph) -> dict | None:
    """The fused CPU step's plan (passes/plan_cpu_step.py) as recorded on the nodes: each run's first and last node,
    node count, kernels and row bound, and the nodes left out grouped by reason (None: the graph has no plan)."""
    if not any("step_run" in n.attrs or "step_left_out" in n.attrs for n in graph.nodes):
        return None
    runs: dict[int, list] = {}
    left_out: dict[str, list[str]] = {}
    for n in graph.nodes:
        if "step_run" in n.attrs:
            runs.setdefault(n.attrs["step_run"], []).append(n)
        elif "step_left_out" in n.attrs:
            left_out.setdefault(n.attrs["step_left_out"], []).append(n.name)
    return {"runs": [{"first": ns[0].name, "last": ns[-1].name, "num_nodes": len(ns),
                      "kernels": dict(sorted(Counter(n.kernel for n in ns).items())),
                      "max_rows": min((n.attrs["step_max_rows"] for n in ns if "step_max_rows" in n.attrs),
                                      default=None)} for ns in runs.values()],
            "left_out": left_out}


def _render_cpu_step(plan: dict | None, num_nodes: int) -> list[str]:
    if plan is None:
        return ["cpu step   not planned (no plan_cpu_step pass): every node runs one by one"]
    fused = sum(r["num_nodes"] for r in plan["runs"])
    lines = [f"cpu step   {len(plan['runs'])} fused run(s), {fused} of {num_nodes} nodes (plan_cpu_step)"]
    for i, r in enumerate(plan["runs"]):
        rows = f", steps of up to {r['max_rows']} rows" if r["max_rows"] is not None else ""
        kernels = ", ".join(f"{k} x{v}" for k, v in r["kernels"].items())
        lines.append(f"  run {i}: {r['first']} .. {r['last']}, {r['num_nodes']} nodes ({kernels}){rows}")
    for why, names in plan["left_out"].items():
        lines.append(f"  left out x{len(names)} ({names[0]}{', ...' if len(names) > 1 else ''}): {why}")
    return lines


def _moe(config) -> dict | None:
    """A MoE model's experts: count, size, top-k, and which layers route (None for a dense model)."""
    if not config.num_experts:
        return None
    return {"num_experts": config.num_experts, "top_k": config.num_experts_per_tok,
            "moe_intermediate_size": config.moe_intermediate_size, "norm_topk_prob": config.norm_topk_prob,
            "moe_layers": [i for i in range(config.num_layers) if config.is_moe(i)],
            "dense_layers": list(config.dense_layers),
            "shared_expert_intermediate_size": config.shared_expert_intermediate_size,
            "routed_scaling_factor": config.routed_scaling_factor, "num_expert_groups": config.num_expert_groups,
            "topk_groups": config.topk_groups}


def _routing(moe: dict) -> str:
    """DeepSeek-V2's routing and shared experts, when the model has them."""
    out = ""
    if moe.get("num_expert_groups", 1) > 1:
        out += f", the best {moe['topk_groups']} of {moe['num_expert_groups']} expert groups"
    if moe.get("routed_scaling_factor", 1.0) != 1.0:
        out += f", weights x{moe['routed_scaling_factor']:g}"
    if moe.get("shared_expert_intermediate_size"):
        out += f"; shared experts of intermediate {moe['shared_expert_intermediate_size']}"
    return out


def _mla(config) -> dict | None:
    """An MLA model's latent cache and ranks, and what an MHA cache of the same heads would hold (None: not MLA)."""
    if not config.is_mla:
        return None
    return {"kv_lora_rank": config.kv_lora_rank, "qk_rope_head_dim": config.head_dim,
            "q_lora_rank": config.q_lora_rank, "qk_nope_head_dim": config.qk_nope_head_dim,
            "v_head_dim": config.v_head_dim,
            "mha_values": config.num_heads * (config.qk_nope_head_dim + config.head_dim + config.v_head_dim)}


def _groups(groups: list[dict]) -> str:
    """The KV-cache groups (one block table each) as "full attention: layers 5, 11; window 512: layers 0, ..."."""
    return "; ".join(f"{'full attention' if g['window'] is None else 'window ' + str(g['window'])}: layers "
                     f"{_ranges(g['layers'])}" for g in groups)


def _ranges(layers: list[int]) -> str:
    return ", ".join(map(str, layers))


def _by_m(table: list) -> str:
    """[[1, "a"], [128, "b"], [None, "a"]] -> "M<=1 a, M<=128 b, M>128 a"."""
    parts, prev = [], None
    for bound, k in table:
        parts.append(f"M<={bound} {k}" if bound is not None else f"M>{prev} {k}")
        prev = bound
    return ", ".join(parts)


def _cached_choices(graph) -> dict[str, dict[str, list]]:
    """Per node shape, the per-M tables a GPU's first load measured and cached on this machine, by device."""
    from optc.kernels.choose_cuda import cached_choices

    return cached_choices(graph)


def _layouts(names: set[str]) -> dict[str, str]:
    """Kernel -> the in-memory weight layout its prepare makes, for the kernels that have one."""
    from optc.kernels.registry import KERNELS

    return {k: KERNELS[k].layout for k in sorted(names) if k in KERNELS and KERNELS[k].layout}
