"""Load an artifact: check it (schema, sizes, sha256, target), bind its graph, and return a Model.

Only JSON and safetensors are read; nothing is unpickled. The runtime never imports the frontend or
the passes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from optc.artifact import ArtifactError, check_target, read_manifest, verify_files
from optc.ir import REFERENCE_KERNEL, Graph
from optc.ops import VerifyError, verify
from optc.runtime.model import Model
from optc.store import TensorStore


@dataclass
class Artifact:
    model: Model
    tokenizer_dir: Path
    manifest: dict
    path: Path


def load(path: str | Path, device: str = "cpu", verify_hashes: bool = True) -> Artifact:
    path = Path(path)
    if not path.is_dir():
        raise ArtifactError(f"artifact {path} does not exist; build it with `optc build RECIPE --out {path}`")
    manifest = read_manifest(path)
    check_target(manifest, device)
    verify_files(path, manifest, hashes=verify_hashes)
    graph = Graph.from_json(json.loads((path / "graph.json").read_text()))
    files = sorted(path.glob("weights-*.safetensors"))
    store = TensorStore.from_safetensors(files)
    try:
        verify(graph, store)
    except VerifyError as e:
        raise ArtifactError(f"{path}: the graph and weights disagree ({e}); rebuild the artifact") from None
    model = Model(graph, store, device, kv_dtype=manifest["kv_layout"].get("dtype"), impls=_impls(graph))
    return Artifact(model, path / "tokenizer", manifest, path)


def _impls(graph: Graph) -> dict:
    """Implementations for the non-reference kernels the graph's nodes are bound to."""
    names = {n.kernel for n in graph.nodes} - {REFERENCE_KERNEL}
    if not names:
        return {}
    from optc.kernels.registry import impls  # Triton launchers adapted to the op signature

    return impls(names)
