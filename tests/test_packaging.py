"""The install maps passes/, kernels/ and runtime/ into the optc namespace and ships every subpackage."""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_installed():
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = tool["package-dir"]
    assert dirs == {"optc": "optc", "optc.passes": "passes", "optc.kernels": "kernels", "optc.runtime": "runtime"}
    expected = set()
    for name, folder in dirs.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder).parts
            expected.add(".".join((name, *rel)))
    assert set(tool["packages"]) == expected


def test_optc_namespace_resolves_to_the_sibling_folders():
    import optc.kernels
    import optc.passes
    import optc.runtime

    for module, folder in ((optc.passes, "passes"), (optc.kernels, "kernels"), (optc.runtime, "runtime")):
        assert Path(module.__file__).parent.name == folder
