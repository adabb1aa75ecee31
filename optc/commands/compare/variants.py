"""Variants of one recipe: the recipe edits of a comparison, expanded and validated before any build.

Three ways to get them from a base recipe (already resolved: overrides and `--model` applied):
leave-one-out (the base, then each of its passes dropped), add-one (the bare recipe -- the base
with no passes -- then each of the base's passes added to it, then the full base), or a variants
file: YAML mapping a variant name to a list of edits applied to the base, in order:

    no-awq:   [{drop: quantize_awq}]
    gptq:     [{drop: quantize_awq}, {add: {quantize_gptq: {bits: 4}}, after: fuse_gate_up}]
    fp16:     [{set: {dtype: float16}}]

`drop: NAME` removes the pass, `add: NAME | {NAME: options}` inserts it (at the end, or `before:` /
`after:` a named pass), `set: {dotted.key: value}` sets recipe keys. Every variant is turned into a
resolved `Recipe` here and validated like a recipe file; an error names the variant and the edit.
A variant that would build the same artifact as an earlier one (dropping a `cast` the build
re-inserts unchanged, or two identical recipes) is kept out with the reason. Not here: building.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import yaml

from optc.core.errors import UserError
from optc.frontend.recipe import Recipe, resolve_passes
from optc.frontend.schema import RecipeError, validate

BASE = "base"


class Mode(StrEnum):
    LEAVE_ONE_OUT = "leave-one-out"
    ADD_ONE = "add-one"
    FILE = "file"


@dataclass(frozen=True)
class Variant:
    """One recipe of a comparison; `edits` says how it differs from the base (for the report)."""

    name: str
    recipe: Recipe
    edits: tuple[str, ...]
    pass_name: str | None = None  # the pass whose effect this variant measures (leave-one-out, add-one)


@dataclass(frozen=True)
class Skipped:
    name: str
    reason: str


@dataclass(frozen=True)
class Expansion:
    """The variants to build, in order; `baseline` names the one every delta is taken against."""

    variants: tuple[Variant, ...]
    skipped: tuple[Skipped, ...]
    baseline: str
    mode: Mode


def expand(base: Recipe, mode: Mode, variants_file: Path | None = None) -> Expansion:
    """The validated variants of `base` in `mode`."""
    if mode is Mode.LEAVE_ONE_OUT:
        specs = [(BASE, [], None, ("the recipe",))]
        specs += [(f"-{p.name}", [{"drop": p.name}], p.name, (f"drop {p.name}",)) for p in base.passes]
        baseline = BASE
    elif mode is Mode.ADD_ONE:
        bare = [{"drop": p.name} for p in base.passes]
        specs = [("bare", bare, None, ("no passes",))]
        for i, p in enumerate(base.passes):
            kept = [{"drop": q.name} for j, q in enumerate(base.passes) if j != i]
            specs.append((f"+{p.name}", kept, p.name, (f"only {p.name}",)))
        specs.append(("full", [], None, ("the recipe",)))
        baseline = "bare"
    else:
        if variants_file is None:
            raise UserError("--variants FILE is needed for mode file")
        specs = [(BASE, [], None, ("the recipe",))]
        specs += [(n, e, None, tuple(_describe(x) for x in e)) for n, e in read_variants_file(variants_file)]
        baseline = BASE
    names = [s[0] for s in specs]
    if len(set(names)) != len(names):
        raise UserError(f"variant names must be unique; {BASE!r} is the unedited recipe")
    variants, skipped = [], []
    seen: dict[str, str] = {}  # effective build -> first variant name
    for name, edits, pass_name, described in specs:
        recipe = apply_edits(base, name, edits)
        key = _effective_key(recipe)
        if key in seen:
            skipped.append(Skipped(name, f"builds the same artifact as {seen[key]!r}" + _why_same(base, edits)))
            continue
        seen[key] = name
        variants.append(Variant(name, recipe, described, pass_name))
    return Expansion(tuple(variants), tuple(skipped), baseline, mode)


def read_variants_file(path: Path) -> list[tuple[str, list]]:
    """[(name, edits)] from a variants YAML file, in file order."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"variants file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise UserError(f"{path}: malformed YAML: {getattr(e, 'problem', None) or e}") from None
    if not isinstance(data, dict) or not data:
        raise UserError(f"{path}: expected a mapping of variant name -> list of edits "
                        "({drop: PASS}, {add: PASS or {PASS: options}}, {set: {KEY: VALUE}})")
    out = []
    for name, edits in data.items():
        if not isinstance(edits, list) or not edits:
            raise UserError(f"{path}: variant {name!r}: expected a non-empty list of edits, got {edits!r}")
        out.append((str(name), edits))
    return out


def apply_edits(base: Recipe, name: str, edits: list) -> Recipe:
    """The base recipe with `edits` applied, validated; errors name the variant and the edit."""
    data = json.loads(json.dumps(base.to_json()))  # plain data, as a recipe file would give
    passes: list = data.pop("passes")
    for i, edit in enumerate(edits):
        where = f"variant {name!r}, edit {i + 1} ({_describe(edit)})"
        try:
            passes = _apply(edit, data, passes)
        except (RecipeError, UserError, ValueError, TypeError) as e:
            raise UserError(f"{where}: {str(e).splitlines()[0].lstrip(': ')}") from None
    try:
        recipe = validate(Recipe, data, "", {})
        return Recipe(**{**recipe.__dict__, "passes": resolve_passes(passes, {})})
    except RecipeError as e:
        raise UserError(f"variant {name!r} ({'; '.join(_describe(e) for e in edits)}): "
                        f"{str(e).splitlines()[0].lstrip(': ')}") from None


def _apply(edit: Any, data: dict, passes: list) -> list:
    if not isinstance(edit, dict) or not ({"drop", "add", "set"} & set(edit)):
        raise UserError("an edit is {drop: PASS}, {add: PASS or {PASS: options}[, before|after: PASS]} "
                        "or {set: {KEY: VALUE}}")
    names = [_pass_name(p) for p in passes]
    if "drop" in edit:
        _only(edit, {"drop"})
        if edit["drop"] not in names:
            raise UserError(f"cannot drop {edit['drop']!r}: not among the passes ({', '.join(names) or 'none'})")
        i = names.index(edit["drop"])
        return passes[:i] + passes[i + 1:]
    if "add" in edit:
        _only(edit, {"add", "before", "after"})
        item = edit["add"]
        new = _pass_name(item)
        if new in names:
            raise UserError(f"cannot add {new!r}: the recipe already runs it (drop it first to change its options)")
        resolve_passes([copy.deepcopy(item)], {})  # unknown pass or bad options: fail here, with this edit
        if "before" in edit and "after" in edit:
            raise UserError("give one of before/after, not both")
        anchor = edit.get("before", edit.get("after"))
        if anchor is None:
            return passes + [item]
        if anchor not in names:
            raise UserError(f"{anchor!r} is not among the passes ({', '.join(names) or 'none'})")
        i = names.index(anchor) + (1 if "after" in edit else 0)
        return passes[:i] + [item] + passes[i:]
    _only(edit, {"set"})
    if not isinstance(edit["set"], dict) or not edit["set"]:
        raise UserError("set: expected a mapping of dotted keys to values, e.g. {set: {dtype: float16}}")
    for key, value in edit["set"].items():
        if key == "passes" or str(key).startswith("passes."):
            raise UserError("set: passes are edited with drop/add")
        parts = str(key).split(".")
        node = data
        for p in parts[:-1]:
            if not isinstance(node.get(p), dict):
                raise UserError(f"set: {key}: {p!r} is not a section of the recipe")
            node = node[p]
        node[parts[-1]] = value
    return passes


def _only(edit: dict, allowed: set[str]) -> None:
    extra = sorted(set(edit) - allowed)
    if extra:
        raise UserError(f"unexpected key(s) {', '.join(map(repr, extra))}; allowed here: {', '.join(sorted(allowed))}")


def _pass_name(item: Any) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, dict) and len(item) == 1:
        return str(next(iter(item)))
    raise UserError(f"expected a pass name or {{name: {{options}}}}, got {item!r}")


def _effective_key(recipe: Recipe) -> str:
    """What the build actually runs: `cast` to the recipe's dtype is inserted when absent."""
    data = recipe.to_json()
    passes = data["passes"]
    if not any("cast" in p for p in passes):
        passes.insert(0, {"cast": {"dtype": None}})
    passes[:] = [{"cast": {"dtype": None}} if p.get("cast", {}).get("dtype") in (None, recipe.dtype) and "cast" in p
                 else p for p in passes]
    return json.dumps(data, sort_keys=True)


def _why_same(base: Recipe, edits: list) -> str:
    if any(isinstance(e, dict) and e.get("drop") == "cast" for e in edits):
        return f" (the build re-inserts cast to the recipe's dtype {base.dtype})"
    return ""


def _describe(edit: Any) -> str:
    if isinstance(edit, dict):
        return ", ".join(f"{k}: {json.dumps(v, sort_keys=True)}" if not isinstance(v, str) else f"{k}: {v}"
                         for k, v in edit.items())
    return repr(edit)
