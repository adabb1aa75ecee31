"""The artifact: a self-describing directory, written atomically, read without unpickling.

    out/ manifest.json  graph.json  weights-0000K-of-0000N.safetensors  tokenizer/  report.json

`write` builds everything in a temporary sibling and renames it into place when complete, so an
interrupted or failed build leaves no half artifact and never touches an existing one (with
`force`, the old directory is replaced only after the new one is whole). `manifest.json` is
deterministic (same inputs, same bytes); timings and host details go to `report.json`.
`read_manifest`/`verify_files`/`check_target` are what loaders call.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from optc.errors import UserError
from optc.formats import part_name
from optc.ir import Graph
from optc.store import TensorStore

SCHEMA_VERSION = 1
SHARD_BYTES = 2 * 1024**3
MIN_CUDA_CAPABILITY = (8, 0)


class ArtifactError(UserError, ValueError):
    """An artifact that cannot be written or loaded; the message says what to do."""


def weight_keys(graph: Graph) -> list[str]:
    """Every stored part of every tensor the graph uses, in node order."""
    keys = []
    for name in graph.used_tensors():
        info = graph.tensors[name]
        keys.extend(part_name(name, r, info.format) for r in info.format.part_shapes(info.shape))
    return keys


def write(
    out: Path,
    graph: Graph,
    store: TensorStore,
    manifest: dict[str, Any],
    report: dict[str, Any],
    save_tokenizer: Callable[[Path], None],
    force: bool = False,
    progress: Callable[[str], None] = lambda m: None,
    started: float | None = None,
) -> Path:
    """Write the artifact; `report` gains write_seconds, total_seconds (from `started`) and peak_rss_bytes."""
    out = Path(out)
    if out.exists() and not force:
        raise ArtifactError(f"output folder {out} already exists; pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    t0 = time.perf_counter()
    try:
        (tmp / "graph.json").write_text(graph.dumps())
        for fname, keys in _shards(graph, store):
            progress(f"writing {fname} ({len(keys)} tensors)")
            tensors = {k: store.get(k).contiguous() for k in keys}
            save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
            os.chmod(tmp / fname, 0o644)  # save_file creates 0600; the artifact is read by other accounts
            del tensors
        save_tokenizer(tmp / "tokenizer")
        files = {}
        for f in sorted(p for p in tmp.rglob("*") if p.is_file()):
            rel = f.relative_to(tmp).as_posix()
            files[rel] = {"sha256": sha256_file(f), "bytes": f.stat().st_size}
        manifest = {**manifest, "schema_version": SCHEMA_VERSION, "files": files}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        now = time.perf_counter()
        report = {**report, "write_seconds": round(now - t0, 3),
                  "total_seconds": round(now - (started if started is not None else t0), 3),
                  "peak_rss_bytes": peak_rss_bytes()}
        (tmp / "report.json").write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def read_manifest(path: Path) -> dict:
    path = Path(path)
    mpath = path / "manifest.json"
    if not mpath.is_file():
        raise ArtifactError(f"{path} is not an optc artifact (no manifest.json); build one with `optc build`")
    try:
        manifest = json.loads(mpath.read_text())
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{mpath} is not valid JSON ({e}); rebuild the artifact") from None
    version = manifest.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ArtifactError(
            f"{mpath}: artifact schema version {version}, this optc reads version "
            f"{SCHEMA_VERSION}; rebuild it with this optc"
        )
    return manifest


def verify_files(path: Path, manifest: dict, hashes: bool = True) -> None:
    """Check every file the manifest lists: present, same size, and (unless `hashes` is off) same sha256."""
    for rel, meta in manifest["files"].items():
        f = Path(path) / rel
        if not f.is_file():
            raise ArtifactError(f"{f} is missing from the artifact; rebuild it")
        if f.stat().st_size != meta["bytes"]:
            raise ArtifactError(
                f"{f} has {f.stat().st_size} bytes, the manifest says {meta['bytes']}: "
                f"it was truncated or altered after the build; rebuild the artifact"
            )
        if hashes and sha256_file(f) != meta["sha256"]:
            raise ArtifactError(
                f"{f} does not match its sha256 in the manifest: it was altered after the "
                f"build; rebuild the artifact (or load with --no-verify at your own risk)"
            )


def check_target(manifest: dict, device: str) -> None:
    """Refuse a device the artifact was not built for, with what to do instead."""
    target = manifest["target"]["device"]
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ArtifactError("--device cuda was asked for, but this machine has no CUDA GPU; use --device cpu")
    if target == "cuda" and not device.startswith("cuda"):
        if os.environ.get("TRITON_INTERPRET") == "1":
            return  # the Triton interpreter runs cuda-targeted kernels on the CPU (tests only)
        cc = ".".join(map(str, manifest["target"].get("min_compute_capability") or MIN_CUDA_CAPABILITY))
        has_gpu = (
            "this machine's GPU is not selected (use --device cuda)"
            if torch.cuda.is_available()
            else "this machine has no GPU"
        )
        raise ArtifactError(
            f"artifact built for cuda (compute capability >= {cc}); {has_gpu} - "
            f"rebuild with `--set target=cpu` to run on the CPU"
        )
    if target == "cuda":
        need = tuple(manifest["target"].get("min_compute_capability") or MIN_CUDA_CAPABILITY)
        have = torch.cuda.get_device_capability(torch.device(device))
        if have < need:
            raise ArtifactError(
                f"artifact needs compute capability >= {need[0]}.{need[1]}, this GPU has "
                f"{have[0]}.{have[1]}; rebuild with `--set target=cpu`"
            )


def _shards(graph: Graph, store: TensorStore) -> list[tuple[str, list[str]]]:
    groups: list[list[str]] = [[]]
    size = 0
    for key in weight_keys(graph):
        e = store.entry(key)
        nbytes = e.dtype.itemsize * max(1, _numel(e.shape))
        if groups[-1] and size + nbytes > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += nbytes
    n = len(groups)
    return [(f"weights-{i + 1:05d}-of-{n:05d}.safetensors", g) for i, g in enumerate(groups)]


def peak_rss_bytes() -> int | None:
    """This process's peak resident memory so far (Linux: ru_maxrss is KiB)."""
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    except (ImportError, OSError):
        return None


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()
