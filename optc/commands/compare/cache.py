"""The build cache of `optc compare`: one artifact per (resolved recipe, source files, optc version).

The key is the sha256 of the resolved recipe's hash (`Recipe.sha256()`, what the manifest records
as `recipe_sha256`), the source record without its local path (kind, id, revision, seed, the sha256
of every source file: the manifest's `source`), the optc version and the artifact schema version
(a newer optc reads no older artifact, so it rebuilds them). An entry is a finished artifact
folder `<key[:20]>/` (written atomically by `optc build`) and `<key[:20]>.json` with the key and the
build's wall time; a hit is re-checked against the artifact's manifest, so an edited or foreign
folder is rebuilt, never trusted. A second run of the same comparison builds nothing.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import optc
from optc.core.artifact import SCHEMA_VERSION, ArtifactError, read
from optc.frontend.recipe import Recipe
from optc.frontend.sources import cache_root

KEY_CHARS = 20


def default_cache_dir() -> Path:
    return cache_root() / "compare"


@dataclass(frozen=True)
class CachedBuild:
    artifact: Path
    key: str
    build_seconds: float  # wall time of the build that made it (earlier, on a hit)
    is_hit: bool


def cache_key(recipe: Recipe, source_record: dict) -> str:
    source = {k: v for k, v in source_record.items() if k != "path"}
    blob = {"recipe_sha256": recipe.sha256(), "source": source, "optc_version": optc.__version__,
            "artifact_schema": SCHEMA_VERSION}
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()


def lookup(cache_dir: Path, recipe: Recipe, source_record: dict) -> CachedBuild | None:
    """The cached artifact of this recipe and source, if one is there and its manifest agrees."""
    key = cache_key(recipe, source_record)
    folder, meta_path = _paths(cache_dir, key)
    if not folder.is_dir() or not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
        manifest = read(folder, verify=False).manifest  # a damaged or older artifact is a miss: rebuilt
    except (OSError, json.JSONDecodeError, ArtifactError):
        return None
    if (meta.get("key") != key or manifest.recipe_sha256 != recipe.sha256()
            or manifest.source.get("files") != source_record.get("files")):
        return None
    return CachedBuild(folder, key, float(meta["build_seconds"]), is_hit=True)


def build_cached(cache_dir: Path, recipe: Recipe, source_record: dict, quiet: bool = True) -> CachedBuild:
    """The artifact of `recipe`: from the cache, or built with `optc build` and stored there."""
    hit = lookup(cache_dir, recipe, source_record)
    if hit is not None:
        return hit
    from optc.commands.eval import evaluate_build
    from optc.frontend.build import BuildOptions, build

    key = cache_key(recipe, source_record)
    folder, meta_path = _paths(cache_dir, key)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="optc-compare-recipe-") as tmp:
        recipe_path = Path(tmp) / "recipe.yaml"  # JSON is YAML: the resolved recipe, re-validated by build
        recipe_path.write_text(json.dumps(recipe.to_json(), indent=1))
        t0 = time.perf_counter()
        build(BuildOptions(recipe=recipe_path, out=folder, force=True, quiet=quiet), evaluate=evaluate_build)
        seconds = time.perf_counter() - t0
    manifest = read(folder, verify=False).manifest
    if manifest.recipe_sha256 != recipe.sha256():
        raise RuntimeError(f"{folder}: the build recorded recipe_sha256 {manifest.recipe_sha256}, expected "
                           f"{recipe.sha256()} (the resolved recipe did not survive a round trip)")
    meta_path.write_text(json.dumps({"key": key, "build_seconds": round(seconds, 3),
                                     "recipe": recipe.to_json()}, indent=1, sort_keys=True) + "\n")
    return CachedBuild(folder, key, seconds, is_hit=False)


def _paths(cache_dir: Path, key: str) -> tuple[Path, Path]:
    return Path(cache_dir) / key[:KEY_CHARS], Path(cache_dir) / f"{key[:KEY_CHARS]}.json"
