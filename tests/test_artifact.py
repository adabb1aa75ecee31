"""Artifact: deterministic bytes, atomic writes, verified loads, target checks."""

from __future__ import annotations

import json

import pytest

from optc.core.artifact import ArtifactError, Target, check_target, read, read_manifest
from optc.testing import build_artifact


def test_same_recipe_twice_gives_identical_bytes(tmp_path, recipes):
    a = build_artifact(tmp_path / "a", recipes / "tiny.yaml")
    b = build_artifact(tmp_path / "b", recipes / "tiny.yaml")
    files = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    assert "manifest.json" in files and "weights-00001-of-00001.safetensors" in files
    for rel in files:
        if rel != "report.json":
            assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel


def test_manifest_describes_the_build(tiny_artifact):
    m = read_manifest(tiny_artifact).to_json()
    assert json.loads((tiny_artifact / "manifest.json").read_text()) == m
    assert m["source"] == {"kind": "random", "id": "random:tiny", "seed": 0}
    assert [p["name"] for p in m["passes"]] == ["cast", "fuse_qkv", "fuse_gate_up"]
    assert m["recipe"]["dtype"] == "float32" and len(m["recipe_sha256"]) == 64
    assert m["model"]["num_kv_heads"] == 2
    assert m["kv_layout"] == {"block_size": 16, "dtype": "float32", "scales": "none"}
    assert m["target"] == {"device": "cpu", "min_compute_capability": None}
    assert set(m["toolchain"]) == {"torch", "transformers", "triton"}
    assert all(len(f["sha256"]) == 64 and f["bytes"] > 0 for f in m["files"].values())
    assert "seconds" not in json.dumps(m), "timings belong in report.json"
    report = json.loads((tiny_artifact / "report.json").read_text())
    assert report["total_seconds"] >= report["write_seconds"] > 0 and report["peak_rss_bytes"] > 0
    assert all(p.stat().st_mode & 0o444 == 0o444 for p in tiny_artifact.rglob("*") if p.is_file()), "unreadable"


def test_failed_build_leaves_nothing_and_keeps_the_old_artifact(tmp_path, recipes, monkeypatch):
    out = build_artifact(tmp_path / "a", recipes / "tiny.yaml")
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}

    def broken(*args, **kwargs):
        raise OSError("disk full (synthetic)")

    monkeypatch.setattr("optc.core.artifact.write_weights_file", broken)
    with pytest.raises(OSError, match="synthetic"):
        build_artifact(tmp_path / "new", recipes / "tiny.yaml")
    assert not (tmp_path / "new").exists()
    from optc.frontend.build import BuildOptions, build

    with pytest.raises(OSError, match="synthetic"):
        build(BuildOptions(recipe=recipes / "tiny.yaml", out=out, force=True, quiet=True))
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"], "a temporary folder was left behind"


def test_load_checks_schema_and_hashes(tmp_path, tiny_artifact):
    import shutil

    out = tmp_path / "a"
    shutil.copytree(tiny_artifact, out)
    (out / "graph.json").write_text((out / "graph.json").read_text().replace('"eps": 1e-05', '"eps": 2e-05'))
    with pytest.raises(ArtifactError, match="graph.json.*sha256"):
        read(out)
    read(out, verify=False)  # --no-verify skips the hash check (sizes are equal here)
    m = json.loads((out / "manifest.json").read_text())
    m["schema_version"] = 99
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match="schema version 99.*rebuild"):
        read(out)
    m["schema_version"] = 2
    m["flavor"] = "x"
    del m["toolchain"]
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match=r"manifest.json: unknown keys \['flavor'\]; missing keys \['toolchain'\]"):
        read(out)
    with pytest.raises(ArtifactError, match="not an optc artifact"):
        read(tmp_path)
    with pytest.raises(ArtifactError, match="does not exist"):
        read(tmp_path / "nothing")


def test_target_check_messages(monkeypatch, tiny_artifact):
    from dataclasses import replace

    import torch

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    manifest = read_manifest(tiny_artifact)
    cuda = replace(manifest, target=Target("cuda", (8, 0)))
    cpu = replace(manifest, target=Target("cpu"))

    if not torch.cuda.is_available():
        with pytest.raises(ArtifactError, match=
            r"built for cuda \(compute capability >= 8.0\); this machine has no GPU"):
            check_target(cuda, "cpu")
        with pytest.raises(ArtifactError, match="no CUDA GPU; use --device cpu"):
            check_target(cpu, "cuda")
    check_target(cpu, "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    check_target(cuda, "cpu")  # the interpreter runs cuda-bound kernels on the CPU
