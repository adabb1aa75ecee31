"""The artifact: a self-describing directory, written atomically, read without unpickling.

    out/ manifest.json  graph.json  weights-0000K-of-0000N.safetensors  tokenizer/  report.json

`write` builds everything in a temporary sibling and renames it into place when complete, so an
interrupted or failed build leaves no half artifact and never touches an existing one (with
`force`, the old directory is replaced only after the new one is whole, in one atomic exchange on Linux).
A build killed outright (SIGKILL) leaves its temporary sibling behind; the next write to the same folder
removes it (tests/test_build_kill.py kills builds at random moments). `manifest.json` is
deterministic (same inputs, same bytes); timings and host details go to `report.json`.

`Manifest` is the typed contract of `manifest.json`; `read(path)` is the one way every reader
(runtime loader, eval, bench, inspect, export, compare) opens an artifact: it checks the schema
version, file sizes and hashes, the target against a device, and that graph and weights agree.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from optc.core.errors import UserError
from optc.core.formats import part_name
from optc.core.ir import Graph, ModelConfig
from optc.core.kv_cache import KVCacheSpec
from optc.core.settings import RuntimeSettings
from optc.core.store import TensorStore
from optc.core.weights_file import write_weights_file

# 2: model.dtype in the model config; 3: typed runtime (max_num_seqs) and kv_layout.scales; 4: the model
# families' op attributes and per-layer config (`silu_mul` became `gated_act {act: silu}`)
SCHEMA_VERSION = 4
READABLE_SCHEMA_VERSIONS = (2, 3, 4)  # an older manifest and graph read as their version-4 equivalents
SHARD_BYTES = 2 * 1024**3
MIN_CUDA_CAPABILITY = (8, 0)


class ArtifactError(UserError, ValueError):
    """An artifact that cannot be written or loaded; the message says what to do."""


@dataclass(frozen=True)
class Target:
    device: str  # "cpu" | "cuda"
    min_compute_capability: tuple[int, int] | None = None  # cuda only


@dataclass(frozen=True)
class Manifest:
    """manifest.json: what an artifact is and how it was made (deterministic: no timings)."""

    optc_version: str
    source: dict[str, Any]  # kind, path or id, revision, sha256 of every file read
    recipe: dict[str, Any]  # the resolved recipe
    recipe_sha256: str
    passes: list[dict[str, Any]]  # name, options, changed, stats, in order
    model: ModelConfig
    target: Target
    kv_layout: KVCacheSpec  # written by the kv_layout pass (its default without the pass)
    toolchain: dict[str, str | None]
    runtime: RuntimeSettings  # the recipe's runtime section: engine defaults
    quantization: dict[str, Any] | None = None
    cuda_graphs: dict[str, Any] | None = None  # {batch_sizes} planned by the cuda_graphs pass
    quality: dict[str, Any] | None = None  # optc eval numbers, when the recipe asked for them
    draft_head: dict[str, Any] | None = None  # the EAGLE head's shape and its training record or import source
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> {sha256, bytes}; set by write
    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["model"] = self.model.to_json()
        d["target"] = dataclasses.asdict(self.target)
        if self.target.min_compute_capability is not None:
            d["target"]["min_compute_capability"] = list(self.target.min_compute_capability)
        d["kv_layout"] = self.kv_layout.to_json()
        d["runtime"] = self.runtime.to_json()
        return d

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n"

    @staticmethod
    def from_json(d: dict[str, Any], where: str = "manifest.json") -> Manifest:
        """A manifest from its JSON; ArtifactError naming `where` for another schema version or a
        missing or unknown key."""
        version = d.get("schema_version")
        if version not in READABLE_SCHEMA_VERSIONS:
            raise ArtifactError(f"{where}: artifact schema version {version}, this optc reads versions "
                                f"{', '.join(map(str, READABLE_SCHEMA_VERSIONS))}; rebuild it with this optc")
        names = {f.name for f in dataclasses.fields(Manifest)}
        required = {f.name for f in dataclasses.fields(Manifest)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        unknown, missing = sorted(set(d) - names), sorted(required - set(d))
        if unknown or missing:
            problems = [f"{what} keys {keys}" for what, keys in (("unknown", unknown), ("missing", missing)) if keys]
            raise ArtifactError(f"{where}: {'; '.join(problems)}; rebuild the artifact with this optc")
        try:
            target = d["target"]
            cc = target.get("min_compute_capability")
            return Manifest(**{**d, "model": ModelConfig.from_json(d["model"]),
                               "target": Target(target["device"], tuple(cc) if cc else None),
                               "kv_layout": KVCacheSpec.from_json(d["kv_layout"]),
                               "runtime": RuntimeSettings.from_json(d["runtime"] or {}),
                               "schema_version": SCHEMA_VERSION})
        except (TypeError, ValueError, KeyError, AttributeError, ZeroDivisionError) as e:
            raise ArtifactError(f"{where}: a damaged section ({type(e).__name__}: {e}); rebuild the artifact") \
                from None


@dataclass(frozen=True)
class Artifact:
    """An artifact opened by `read`: nothing is loaded but the JSON (weights are read lazily)."""

    path: Path
    manifest: Manifest
    graph: Graph
    store: TensorStore
    tokenizer_dir: Path
    # weights file -> (bytes, mtime_ns, inode) when `read` checked it: `check_unchanged` compares
    stamps: dict[str, tuple[int, int, int]] = field(default_factory=dict)


def read(path: str | Path, verify: bool = True, device: str | None = None) -> Artifact:
    """Open an artifact: schema version, every file present with its size (and, with `verify`, its
    sha256), the target against `device` when given, and the graph against the weights."""
    from optc.core.ops import VerifyError
    from optc.core.ops import verify as verify_graph

    path = Path(path)
    if not path.is_dir():
        raise ArtifactError(f"artifact {path} does not exist; build it with `optc build RECIPE --out {path}`")
    manifest = read_manifest(path)
    if device is not None:
        check_target(manifest, device)
    stamps = {rel: _stamp(path / rel) for rel in manifest.files if rel.startswith("weights-") and
              (path / rel).is_file()}  # before the hashes: a change while they are computed shows later
    verify_files(path, manifest, hashes=verify)
    try:
        graph = Graph.from_json(_upgrade_graph(json.loads((path / "graph.json").read_text())))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ArtifactError(f"{path / 'graph.json'} cannot be read ({type(e).__name__}: {e}); rebuild the artifact") \
            from None
    store = TensorStore.from_safetensors(sorted(path / f for f in manifest.files if f.startswith("weights-")))
    try:
        verify_graph(graph, store)
    except VerifyError as e:
        raise ArtifactError(f"{path}: the graph and weights disagree ({e}); rebuild the artifact") from None
    return Artifact(path, manifest, graph, store, path / "tokenizer", stamps)


def check_unchanged(artifact: Artifact, error: BaseException | None = None) -> None:
    """Raise an ArtifactError naming every weights file that was truncated, rewritten or replaced since
    `read` checked it (a loader calls this after reading the weights, and when reading them failed: `error`,
    chained). Nothing to say (None) when every file is as it was."""
    changed = []
    for rel, before in artifact.stamps.items():
        f = artifact.path / rel
        now = _stamp(f) if f.is_file() else None
        if now != before:
            what = "removed" if now is None else f"{before[0]} -> {now[0]} bytes" if now[0] != before[0] \
                else "rewritten or replaced"
            changed.append(f"{f} ({what})")
    if changed:
        cause = f"; reading it failed with {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}" \
            if error is not None else ""
        raise ArtifactError(f"{', '.join(changed)} changed while the artifact was being loaded{cause}: load it "
                            "again once whatever writes it is done, or rebuild the artifact") from error


def _stamp(f: Path) -> tuple[int, int, int]:
    st = f.stat()
    return st.st_size, st.st_mtime_ns, st.st_ino


def _upgrade_graph(d: dict[str, Any]) -> dict[str, Any]:
    """A graph.json of schema 2 or 3 in schema 4's vocabulary: its SwiGLU nodes (`silu_mul`, bound to
    `triton.silu_mul` or the reference) become `gated_act {act: silu}` (the same math and kernel)."""
    for node in d["nodes"]:
        if node["op"] == "silu_mul":
            node["op"] = "gated_act"
            node["attrs"]["act"] = "silu"
            if node["attrs"].get("kernel") == "triton.silu_mul":
                node["attrs"]["kernel"] = "triton.gated_act"
    return d


def weight_keys(graph: Graph) -> list[str]:
    """Every stored part of every tensor in the graph's table: those its nodes use, in node order, then the
    others (a draft head's, which the manifest's `draft_head` section names)."""
    keys = []
    used = graph.used_tensors()
    for name in used + [t for t in graph.tensors if t not in set(used)]:
        info = graph.tensors[name]
        keys.extend(part_name(name, r, info.format) for r in info.format.part_shapes(info.shape))
    return keys


def write(
    out: Path,
    graph: Graph,
    store: TensorStore,
    manifest: Manifest,
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
    remove_stale_temporaries(out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    t0 = time.perf_counter()
    try:
        (tmp / "graph.json").write_text(graph.dumps())
        for fname, keys in _shards(graph, store):
            progress(f"writing {fname} ({len(keys)} tensors)")
            specs = {k: (store.entry(k).shape, store.entry(k).dtype) for k in keys}
            # each tensor produced, written at its offset and dropped: a build holds one tensor, not a shard
            write_weights_file(tmp / fname, specs, store.get, metadata={"format": "pt"})
            os.chmod(tmp / fname, 0o644)  # the artifact is read by other accounts
        save_tokenizer(tmp / "tokenizer")
        files = {}
        for f in sorted(p for p in tmp.rglob("*") if p.is_file()):
            rel = f.relative_to(tmp).as_posix()
            files[rel] = {"sha256": sha256_file(f), "bytes": f.stat().st_size}
        (tmp / "manifest.json").write_text(dataclasses.replace(manifest, files=files).dumps())
        now = time.perf_counter()
        report = {**report, "write_seconds": round(now - t0, 3),
                  "total_seconds": round(now - (started if started is not None else t0), 3),
                  "peak_rss_bytes": peak_rss_bytes()}
        (tmp / "report.json").write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
        move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def move_into_place(tmp: Path, out: Path) -> None:
    """Rename a finished folder `tmp` to `out`; an existing `out` is replaced only now, when the new one is whole,
    by an atomic exchange where the OS has one (Linux), so no moment is without `out`; elsewhere by two renames."""
    if not out.exists():
        tmp.rename(out)
    elif _exchange(tmp, out):
        shutil.rmtree(tmp)  # now the old folder
    else:
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old)


def remove_stale_temporaries(out: Path) -> None:
    """Remove the temporaries (`.NAME.tmp-PID`, `.NAME.old-PID`) that writers of `out` killed before they could
    clean up left beside it; those of a writer still running stay."""
    for p in [*out.parent.glob(f".{out.name}.tmp-*"), *out.parent.glob(f".{out.name}.old-*")]:
        pid = p.name.rpartition("-")[2]
        if pid.isdigit() and not _is_running(int(pid)):
            shutil.rmtree(p, ignore_errors=True)


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another account's process
        return True
    return True


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 with RENAME_EXCHANGE); False where the OS or filesystem cannot."""
    if sys.platform != "linux":
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # a libc without it
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def read_manifest(path: Path) -> Manifest:
    path = Path(path)
    mpath = path / "manifest.json"
    if not mpath.is_file():
        raise ArtifactError(f"{path} is not an optc artifact (no manifest.json); build one with `optc build`")
    try:
        manifest = json.loads(mpath.read_text())
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{mpath} is not valid JSON ({e}); rebuild the artifact") from None
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{mpath} is not a JSON object; rebuild the artifact")
    return Manifest.from_json(manifest, str(mpath))


def verify_files(path: Path, manifest: Manifest, hashes: bool = True) -> None:
    """Check every file the manifest lists: present, same size, and (unless `hashes` is off) same sha256."""
    for rel, meta in manifest.files.items():
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


def check_target(manifest: Manifest, device: str) -> None:
    """Refuse a device the artifact was not built for, with what to do instead."""
    target = manifest.target.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ArtifactError("--device cuda was asked for, but this machine has no CUDA GPU; use --device cpu")
    if target == "cuda" and not device.startswith("cuda"):
        if os.environ.get("TRITON_INTERPRET") == "1":
            return  # the Triton interpreter runs cuda-targeted kernels on the CPU (tests only)
        cc = ".".join(map(str, manifest.target.min_compute_capability or MIN_CUDA_CAPABILITY))
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
        need = tuple(manifest.target.min_compute_capability or MIN_CUDA_CAPABILITY)
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
