"""Recipes: YAML that maps onto the typed `Recipe` schema, with command-line overrides.

`load_recipe(path, overrides)` parses the YAML (malformed YAML is an error with its line), applies
`--set key=value` overrides (dotted keys; values parsed as YAML scalars/lists), validates every key
strictly (unknown keys, unknown passes, wrong types and out-of-range values are errors naming the
key, the value, what is allowed and the line), and resolves each pass's options against that
pass's `Options` dataclass.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import yaml

from optc.core.errors import InputError
from optc.core.settings import RuntimeSettings, SpeculativeConfig
from optc.frontend.schema import RecipeError, json_schema, validate

DTYPE_CHOICES = ("float32", "float16", "bfloat16")


class Target(StrEnum):
    CPU = "cpu"
    CUDA = "cuda"


class SourceQuantization(StrEnum):
    """What a .gguf model's block-quantized tensors become."""

    DEQUANTIZE = "dequantize"  # float32, as transformers loads them: quantization passes may round them again
    KEEP = "keep"  # their codes as they are (int4_gf / int8_gf): llama.cpp's weights bit for bit


@dataclass(frozen=True)
class Calibration:
    """Text the quantization passes calibrate on."""

    source: str = field(
        default="builtin:pydoc",
        metadata={"help": "builtin:pydoc, a .txt file, a .jsonl file with a `text` field, or a HF dataset name"},
    )
    samples: int = field(default=128, metadata={"min": 1, "help": "number of token windows"})
    seq_len: int = field(default=512, metadata={"min": 8, "help": "tokens per window"})
    seed: int = field(default=0, metadata={"min": 0, "help": "seed of the window offsets"})


@dataclass(frozen=True)
class PassSpec:
    name: str
    options: dict[str, Any]


@dataclass(frozen=True)
class Recipe:
    """An optc build recipe."""

    model: str | None = field(
        default=None, metadata={"help": "HF folder, hub id, *.gguf, package:<pkg>/<file> or random:<preset>"}
    )
    dtype: str = field(default="bfloat16", metadata={"choices": DTYPE_CHOICES, "help": "model dtype"})
    target: Target = field(default=Target.CPU, metadata={"help": "device kind the artifact is built for"})
    source_quantization: SourceQuantization = field(default=SourceQuantization.DEQUANTIZE, metadata={
        "help": "a .gguf model's quantized tensors: dequantize (float32, as transformers loads them) or keep (their "
                "codes and scales exactly, in int4_gf / int8_gf; docs/FORMATS.md)"})
    calibration: Calibration = field(default_factory=Calibration)
    passes: tuple[Any, ...] = field(default=(), metadata={"help": "ordered passes: a name, or {name: {options}}"})
    eval: bool = field(default=False, metadata={"help": "measure quality after the build (optc eval)"})
    runtime: RuntimeSettings = field(default_factory=RuntimeSettings)

    def to_json(self) -> dict:
        d = asdict(self)
        d["target"] = self.target.value
        if self.source_quantization is SourceQuantization.DEQUANTIZE:  # recipes from before the key hash as they did
            del d["source_quantization"]
        else:
            d["source_quantization"] = self.source_quantization.value
        d["passes"] = [{p.name: p.options} for p in self.passes]
        return d

    def sha256(self) -> str:
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()


def load_recipe(path: str | Path | None, overrides: list[str] = (), model: str | None = None) -> Recipe:
    """Read, override and validate a recipe; `path=None` starts from the defaults."""
    where: dict[str, str] = {}
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise RecipeError(f"recipe {path} does not exist")
        text = path.read_text()
        try:
            node = yaml.compose(text)
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            line = f":{mark.line + 1}" if mark else ""
            raise RecipeError(f"{path}{line}: malformed YAML: {getattr(e, 'problem', None) or e}") from None
        if not isinstance(data, dict):
            raise RecipeError(
                f"{path}: a recipe is a mapping of keys (model, dtype, passes, ...), got {type(data).__name__}"
            )
        _record_lines(node, "", str(path), where)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise RecipeError(f"--set {item!r}: expected KEY=VALUE, e.g. --set runtime.max_seq_len=2048")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw
        _set_dotted(data, key, value)
        where[key] = f"--set {item}"
    if model is not None:
        data["model"] = model
        where["model"] = "--model"
    raw_passes = data.pop("passes", [])
    recipe = validate(Recipe, data, "", where)
    if recipe.runtime.speculative is not None:
        try:
            SpeculativeConfig.parse(recipe.runtime.speculative)
        except InputError as e:
            key = "runtime.speculative"
            raise RecipeError(f"{where.get(key, where.get('runtime', ''))}: {key}: {e}") from None
    return Recipe(**{**recipe.__dict__, "passes": resolve_passes(raw_passes, where)})


def resolve_passes(raw: Any, where: dict[str, str]) -> tuple[PassSpec, ...]:
    from optc.frontend.passmanager import registry

    passes = registry()
    if not isinstance(raw, list):
        raise RecipeError(f"{where.get('passes', '')}: passes: expected a list of pass names or {{name: options}}")
    specs = []
    for i, item in enumerate(raw):
        key = f"passes[{i}]"
        if isinstance(item, str):
            name, options = item, {}
        elif isinstance(item, dict) and len(item) == 1:
            name, options = next(iter(item.items()))
            options = options or {}
        else:
            raise RecipeError(
                f"{where.get(key, '')}: {key}: expected a pass name or {{name: {{options}}}}, got {item!r}"
            )
        if name not in passes:
            raise RecipeError(
                f"{where.get(key, '')}: {key}: unknown pass {name!r}; known passes: {', '.join(sorted(passes))}"
            )
        opts = validate(passes[name].Options, options, f"{key}.{name}", where)
        specs.append(PassSpec(name, asdict(opts)))
    return tuple(specs)


def recipe_json_schema() -> dict:
    from optc.frontend.passmanager import registry

    schema = json_schema(Recipe)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "optc recipe"
    variants = []
    for name, cls in sorted(registry().items()):
        variants.append({"const": name})
        variants.append(
            {
                "type": "object",
                "properties": {name: json_schema(cls.Options)},
                "required": [name],
                "additionalProperties": False,
                "description": " ".join((cls.__doc__ or "").split()),
            }
        )
    schema["properties"]["passes"] = {
        "type": "array",
        "items": {"anyOf": variants},
        "description": "ordered passes: a name, or {name: {options}}",
    }
    return schema


def _record_lines(node: yaml.Node, path: str, file: str, where: dict[str, str]) -> None:
    where.setdefault(path, f"{file}:{node.start_mark.line + 1}")
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            key = f"{path}.{k.value}" if path else str(k.value)
            where[key] = f"{file}:{k.start_mark.line + 1}"
            _record_lines(v, key, file, where)
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            _record_lines(v, f"{path}[{i}]", file, where)


def _set_dotted(data: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    for p in parts[:-1]:
        nxt = data.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise RecipeError(f"--set {key}: {p!r} is not a section")
        data = nxt
    data[parts[-1]] = value

