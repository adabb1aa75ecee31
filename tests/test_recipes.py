"""Every shipped recipe validates against the schema and names passes that exist."""

from __future__ import annotations

from pathlib import Path

import pytest

from optc.frontend.recipe import load_recipe

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_validates(path):
    recipe = load_recipe(path)
    assert recipe.model, f"{path.name} names no model"
    assert recipe.passes, f"{path.name} has no passes"


def test_overrides_reach_nested_keys(recipes):
    r = load_recipe(recipes / "tiny.yaml", ["runtime.max_seq_len=2048", "dtype=bfloat16", "calibration.samples=4"],
                    model="random:llama-3-8b")
    assert (r.runtime.max_seq_len, r.dtype, r.calibration.samples) == (2048, "bfloat16", 4)
    assert r.model == "random:llama-3-8b"
    assert r.sha256() != load_recipe(recipes / "tiny.yaml").sha256()
