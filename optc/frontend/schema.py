"""Strict validation of plain data (parsed YAML/JSON) against frozen dataclasses, and JSON Schema.

A field's metadata may carry `choices`, `min`, `max` (inclusive), `gt` (exclusive) and `help`.
Errors name the key path, the bad value, what is allowed, and where it came from (file:line or
--set), so a person can fix the recipe without reading code.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from enum import Enum
from typing import Any

from optc.core.errors import UserError


class RecipeError(UserError, ValueError):
    pass


def validate(cls: type, data: Any, path: str, where: dict[str, str]) -> Any:
    """Build `cls` from `data`; `where` maps key paths to 'file:line' for error messages."""
    if not isinstance(data, dict):
        raise _error(path, where, f"expected a mapping, got {_show(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = [k for k in data if k not in fields]
    if unknown:
        key = f"{path}.{unknown[0]}" if path else str(unknown[0])
        raise _error(key, where, f"unknown key {unknown[0]!r}; allowed keys: {', '.join(fields)}")
    values = {}
    for name, value in data.items():
        key = f"{path}.{name}" if path else name
        values[name] = check_value(hints[name], value, key, where, fields[name].metadata)
    missing = [
        n
        for n, f in fields.items()
        if n not in values and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise _error(path or missing[0], where, f"missing required key {missing[0]!r}")
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise _error(path, where, str(e)) from None


def check_value(
    tp: Any, value: Any, key: str, where: dict[str, str], meta: typing.Mapping = types.MappingProxyType({})
):
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return check_value(inner[0], value, key, where, meta)
    if dataclasses.is_dataclass(tp):
        return validate(tp, value, key, where)
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise _error(key, where, f"expected a list, got {_show(value)}")
        return tuple(check_value(args[0], v, f"{key}[{i}]", where, meta) for i, v in enumerate(value))
    if isinstance(tp, type) and issubclass(tp, Enum):
        allowed = [m.value for m in tp]
        if value not in allowed:
            raise _error(key, where, f"{_show(value)} is not allowed; allowed: {', '.join(map(str, allowed))}")
        return tp(value)
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, int | float) and not isinstance(value, bool),
        str: isinstance(value, str),
        dict: isinstance(value, dict),
    }.get(tp, True)
    if not ok:
        raise _error(key, where, f"expected {_type_name(tp)}, got {_show(value)}")
    if "choices" in meta and value not in meta["choices"]:
        raise _error(key, where, f"{_show(value)} is not allowed; allowed: {', '.join(map(str, meta['choices']))}")
    if "min" in meta and value < meta["min"]:
        raise _error(key, where, f"{_show(value)} is below the minimum {meta['min']}")
    if "max" in meta and value > meta["max"]:
        raise _error(key, where, f"{_show(value)} is above the maximum {meta['max']}")
    if "gt" in meta and value <= meta["gt"]:
        raise _error(key, where, f"{_show(value)} must be greater than {meta['gt']}")
    return float(value) if tp is float else value


def json_schema(cls: type) -> dict:
    props, required = {}, []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        props[f.name] = _type_schema(hints[f.name], f.metadata)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            required.append(f.name)
        elif f.default is not dataclasses.MISSING and not dataclasses.is_dataclass(f.default):
            d = f.default
            props[f.name]["default"] = d.value if isinstance(d, Enum) else list(d) if isinstance(d, tuple) else d
    schema = {"type": "object", "properties": props, "additionalProperties": False}
    if cls.__doc__ and not cls.__doc__.startswith(f"{cls.__name__}("):  # not dataclass's generated signature
        schema["description"] = " ".join(cls.__doc__.split())
    if required:
        schema["required"] = required
    return schema


def _type_schema(tp: Any, meta: typing.Mapping) -> dict:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return {"anyOf": [_type_schema(inner[0], meta), {"type": "null"}]}
    if dataclasses.is_dataclass(tp):
        return json_schema(tp)
    if origin in (list, tuple):
        return {"type": "array", "items": _type_schema(args[0], meta)}
    if isinstance(tp, type) and issubclass(tp, Enum):
        s = {"enum": [m.value for m in tp]}
    else:
        s = {
            "type": {bool: "boolean", int: "integer", float: "number", str: "string", dict: "object"}.get(tp, "string")
        }
    for k, j in (
        ("choices", "enum"),
        ("min", "minimum"),
        ("max", "maximum"),
        ("gt", "exclusiveMinimum"),
        ("help", "description"),
    ):
        if k in meta:
            s[j] = list(meta[k]) if k == "choices" else meta[k]
    return s


def _error(key: str, where: dict[str, str], problem: str) -> RecipeError:
    loc = where.get(key) or next((where[k] for k in _parents(key) if k in where), "")
    return RecipeError(f"{loc + ': ' if loc else ''}{key}: {problem}" if key else f"{loc}: {problem}")


def _parents(key: str):
    while "." in key or "[" in key:
        key = key[: max(key.rfind("."), key.rfind("["))]
        yield key


def _show(v: Any) -> str:
    return f"{type(v).__name__} {v!r}" if not isinstance(v, dict | list) else type(v).__name__


def _type_name(tp: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", dict: "a mapping"}.get(
        tp, str(tp)
    )
