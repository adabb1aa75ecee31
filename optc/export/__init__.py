"""`optc export`: an artifact out of optc, into the formats other production stacks run.

    --format onnx --flavor ort       ONNX Runtime: opset 21 + com.microsoft fused operators (optc.export.ort)
    --format onnx --flavor portable  standard ONNX only, for TensorRT and others (optc.export.portable)
    --format tensorrt                a serialized TensorRT engine built from the portable ONNX
                                     (optc.export.tensorrt; needs the tensorrt package and a GPU)

The output folder holds `model.onnx` with its weights in `model.onnx.data` (external data, so
models over 2 GB export), the artifact's tokenizer files, `genai_config.json` for the ort flavor,
and `export.json` (what was exported, how, and the file sizes). Like `optc build`, the folder is
written in a temporary sibling and appears only when complete.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from optc.artifact import move_into_place
from optc.errors import UserError

ONNX_INSTALL = "pip install 'optc[onnx]'"
MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"


class ExportFormat(StrEnum):
    ONNX = "onnx"
    TENSORRT = "tensorrt"


class Flavor(StrEnum):
    ORT = "ort"
    PORTABLE = "portable"


@dataclass(frozen=True)
class ExportOptions:
    artifact: Path
    out: Path
    format: ExportFormat = ExportFormat.ONNX
    flavor: Flavor = Flavor.ORT
    force: bool = False
    verify: bool = True  # sha256 of the artifact's files
    quiet: bool = False


@dataclass(frozen=True)
class ExportResult:
    out: Path
    format: ExportFormat
    flavor: Flavor
    seconds: float
    files: dict[str, int]  # relative path -> bytes

    def to_json(self) -> dict:
        return {"out": str(self.out), "format": self.format.value, "flavor": self.flavor.value,
                "seconds": round(self.seconds, 3), "files": self.files}


def export(options: ExportOptions) -> ExportResult:
    """Export the artifact at `options.artifact` into `options.out`; raise UserError on what the user can fix."""
    t0 = time.perf_counter()
    say = (lambda m: None) if options.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    fmt, flavor = ExportFormat(options.format), Flavor(options.flavor)
    if fmt is ExportFormat.TENSORRT:
        from optc.export.tensorrt import check_tensorrt

        check_tensorrt()  # before any work: says what is missing
        flavor = Flavor.PORTABLE
    _require_onnx()
    out = Path(options.out)
    if out.exists() and not options.force:
        raise UserError(f"output folder {out} already exists; pass --force to replace it")
    from optc.artifact import read

    opened = read(options.artifact, verify=options.verify)
    graph, store, tokenizer_dir = opened.graph, opened.store, opened.tokenizer_dir
    check_kv_layout(opened.manifest.kv_layout)
    if flavor is Flavor.PORTABLE:
        from optc.export.portable import check_portable

        check_portable(graph)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write_onnx(graph, store, tmp, flavor, not options.quiet, say)
        if flavor is Flavor.ORT:
            from optc.export.ort import write_genai_config

            write_genai_config(tmp, graph.config, MODEL_FILE, _tokenizer_config(tokenizer_dir))
        _copy_tokenizer(tokenizer_dir, tmp)
        if fmt is ExportFormat.TENSORRT:
            from optc.export.tensorrt import build_engine

            say("building the TensorRT engine")
            runtime = opened.manifest.runtime
            build_engine(tmp / MODEL_FILE, tmp / "model.engine", graph.config,
                         runtime.max_num_seqs, runtime.max_seq_len or 2048)
        files = {p.relative_to(tmp).as_posix(): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
        result = ExportResult(out, fmt, flavor, time.perf_counter() - t0, files)
        (tmp / "export.json").write_text(
            json.dumps({**result.to_json(), "artifact": str(options.artifact)}, indent=1, sort_keys=True) + "\n"
        )
        move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result


def check_kv_layout(spec) -> None:
    """Refuse a KV format the exported model cannot express: its past/present KV are plain float
    tensors (B, H_kv, T, D) with no scales, and GroupQueryAttention takes no int8 / fp8 cache."""
    if spec.is_quantized:
        raise UserError(
            f"the artifact's KV cache is {spec.dtype} with scales {spec.scales.value} (kv_layout.dtype); the "
            "exported model's past/present KV are float tensors without scales and ONNX Runtime's "
            "GroupQueryAttention takes no quantized cache: rebuild with kv_layout dtype float32, float16 or "
            "bfloat16 to export"
        )


def write_onnx(graph, store, out: Path, flavor: Flavor, show_progress: bool = False,
               progress: Callable[[str], None] = lambda m: None) -> Path:
    """Lower `graph` in `flavor` and save `out/model.onnx` with its weights in `out/model.onnx.data`."""
    import onnx

    from optc.export.ort import OrtLowering
    from optc.export.portable import PortableLowering

    lowering = (OrtLowering if flavor is Flavor.ORT else PortableLowering)(graph, store, show_progress)
    model = lowering.build()
    g = model.graph
    progress(f"writing {MODEL_FILE} and {DATA_FILE} ({len(g.node)} nodes, {len(g.initializer)} tensors)")
    onnx.save_model(model, str(out / MODEL_FILE), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=DATA_FILE, size_threshold=1024)
    return out / MODEL_FILE


def _require_onnx() -> None:
    try:
        import onnx  # noqa: F401
    except ImportError:
        raise UserError(f"optc export needs the onnx package; install it with {ONNX_INSTALL}") from None


def _tokenizer_config(tokenizer_dir: Path) -> dict:
    f = tokenizer_dir / "tokenizer_config.json"
    return json.loads(f.read_text()) if f.is_file() else {}


def _copy_tokenizer(tokenizer_dir: Path, out: Path) -> None:
    """Tokenizer files beside the model, where onnxruntime-genai and Optimum look for them."""
    if tokenizer_dir.is_dir():
        for f in sorted(tokenizer_dir.iterdir()):
            if f.is_file():
                shutil.copyfile(f, out / f.name)
