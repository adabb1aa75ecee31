"""`optc inspect`: a summary of an artifact from its manifest and graph, without loading weights."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from optc.artifact import read


def summarize(path: str | Path, tensor_parallel_size: int | None = None) -> dict:
    """The artifact at `path` (sizes checked, hashes not: inspect reads no weights) as plain data; with
    `tensor_parallel_size`, how each split tensor shards and the weight bytes each rank holds."""
    artifact = read(path, verify=False)
    m, graph = artifact.manifest.to_json(), artifact.graph
    formats = Counter(
        info.format.kind.value
        + ("" if not info.format.is_quantized else f"/g{info.format.group_size}" if info.format.group_size else "")
        for info in graph.tensors.values()
    )
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
        "target": m["target"],
        "toolchain": m["toolchain"],
        "quality": m.get("quality"),
        "formats": dict(sorted(formats.items())),
        "weight_bytes": weight_bytes,
        "total_bytes": sum(f["bytes"] for f in m["files"].values()),
        "num_nodes": len(graph.nodes),
        "ops": dict(sorted(Counter(n.op for n in graph.nodes).items())),
        "kernels": {n.name: n.kernel for n in graph.nodes},
        **({"tensor_parallel": tensor_parallel(graph, tensor_parallel_size)} if tensor_parallel_size else {}),
    }


def tensor_parallel(graph, size: int) -> dict:
    """Per rank: weight bytes, and the slice (axis, ranges) of every tensor it holds a part of; a
    ShardError when the model does not split `size` ways."""
    from optc.ops.sharding import plan_shards, rank_weight_bytes

    plans = [plan_shards(graph, rank, size) for rank in range(size)]
    return {
        "size": size,
        "rank_weight_bytes": [rank_weight_bytes(p.graph) for p in plans],
        "slices": {name: [{"axis": p.slices[name][0], "ranges": [list(r) for r in p.slices[name][1]]} for p in plans]
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
        f"size       weights {s['weight_bytes'] / 2**20:.1f} MiB, total {s['total_bytes'] / 2**20:.1f} MiB",
        f"formats    {', '.join(f'{k} x{v}' for k, v in s['formats'].items())}",
        f"quant      {s['quantization'] or 'none'}",
        f"quality    {s['quality'] or 'not measured'}",
        "passes",
    ]
    for p in s["passes"]:
        stats = ", ".join(f"{k}={v}" for k, v in p["stats"].items() if not isinstance(v, dict | list))
        lines.append(f"  {p['name']:<18} {'changed' if p['changed'] else 'no change':<10} {stats}")
    lines.append(f"ops        {', '.join(f'{k} x{v}' for k, v in s['ops'].items())}")
    kernels = Counter(s["kernels"].values())
    lines.append(f"kernels    {', '.join(f'{k} x{v}' for k, v in sorted(kernels.items()))}")
    for name, k in s["kernels"].items():
        lines.append(f"  {name:<48} {k}")
    tp = s.get("tensor_parallel")
    if tp:
        per_rank = ", ".join(f"{b / 2**20:.2f}" for b in tp["rank_weight_bytes"])
        lines.append(f"tensor parallel {tp['size']} ranks: weights per rank (MiB) {per_rank}; other tensors whole")
        for name, slices in tp["slices"].items():
            axis = "rows" if slices[0]["axis"] == 0 else "columns"
            ranks = " | ".join(",".join(f"{a}:{b}" for a, b in rank["ranges"]) for rank in slices)
            lines.append(f"  {name:<48} {axis:<8} {ranks}")
    return "\n".join(lines)
