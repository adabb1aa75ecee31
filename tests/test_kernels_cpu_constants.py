"""The numbers Python passes into the C++ CPU kernels equal the C++ sources' own: the ISA paths (kernels/cpu_ext
AVX2, AVX512_VNNI, AVX512_BF16 against cpu_ext.h's `enum Isa`, the only one, whose NONE is the 0 `_capped` reads as
"no path") and step.cpp's linear kinds, experts, op kinds and activations (kernels/cpu_ext/step.py's).
A mismatch would run the wrong path or kind without an error, so this reads the sources, no compiler needed."""

from __future__ import annotations

import re

from optc.kernels import cpu_ext
from optc.kernels.cpu_ext import step

ENUM = re.compile(r"enum\s+(\w+)\s*:\s*int64_t\s*\{([^}]*)\}")


def cpp_enum(source: str, name: str) -> dict[str, int]:
    """`enum name : int64_t { A = 0, B = 2 }` in kernels/cpu_ext/<source> as {"A": 0, "B": 2}."""
    text = (cpu_ext.HERE / source).read_text()
    found = [body for enum, body in ENUM.findall(text) if enum == name]
    assert len(found) == 1, f"{source}: {len(found)} `enum {name} : int64_t {{...}}`, expected one"
    values = {}
    for item in found[0].split(","):
        key, _, value = item.partition("=")
        assert value.strip(), f"{source}: enum {name}: {item.strip()!r} has no explicit value"
        values[key.strip()] = int(value.strip(), 0)
    return values


def test_isa_paths_equal_the_cpp_enum():
    python = {name: getattr(cpu_ext, name) for name in ("AVX2", "AVX512_VNNI", "AVX512_BF16")}
    assert cpp_enum("cpu_ext.h", "Isa") == {"NONE": 0, **python}  # best_isa's "no path": _capped reads 0 as None
    assert set(cpu_ext.ISA_NAMES) == set(python.values())


def test_every_enum_is_defined_once():
    """One definition of each enum across the extension's sources, so that no file keeps a copy of its own."""
    found = [name for source in cpu_ext.CPU.sources for name, _ in ENUM.findall((cpu_ext.HERE / source).read_text())]
    assert found and sorted(found) == sorted(set(found)), found


def test_linear_kinds_equal_step_cpp():
    kinds = {name: getattr(step, name) for name in ("DENSE", "INT4PACK", "QDOT", "DENSE_ROWS2", "BF16DOT", "INT4X2",
                                                   "INT8PACK")}
    assert cpp_enum("step.cpp", "Kind") == kinds
    experts = {name: getattr(step, name) for name in ("DENSE_EXPERTS", "INT8PACK_EXPERTS", "INT4PACK_EXPERTS")}
    assert cpp_enum("step.cpp", "Experts") == experts


def test_op_kinds_and_activations_equal_step_cpp():
    """step.py passes a node's op and activation as their index in OPS / ACTS: step.cpp's enums in that order."""
    assert cpp_enum("step.cpp", "Op") == {op.upper(): i for i, op in enumerate(step.OPS)}
    assert cpp_enum("step.cpp", "Act") == {act.upper(): i for i, act in enumerate(step.ACTS)}
