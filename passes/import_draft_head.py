"""Import a published EAGLE-1 draft head (github.com/SafeAILab/EAGLE) into the artifact, in place of
training one (passes/train_draft_head.py).

The checkpoint is a directory as EAGLE's `EaModel.from_pretrained` reads it: `config.json` (a Llama
config of one layer, with EAGLE's `bias` key for the fc) and `model.safetensors` or `pytorch_model.bin`
with `fc.weight` (H, 2H), `fc.bias` (when `bias`), and one decoder layer under `layers.0.`: q/k/v/o
projections, the gate/up/down MLP and `post_attention_layernorm` (EAGLE-1's first layer has no input
norm; eagle/model/cnets1.py). Its math is optc's head (optc/core/eagle.py) with `input_norm` off: the
feature is the target's last hidden state after its final norm (the lm_head's input), entry p pairs f_p
with token p + 1 at position p, the drafted feature goes to the target's lm_head over the whole
vocabulary. The checkpoint's own `embed_tokens` (some carry a copy) is not used: the target's is.

Refused by name: EAGLE-3 checkpoints (a 3H-wide fc over three layers' features, a 2H attention input
and a draft vocabulary map: another head), q/k/v biases, a `rope_scaling`, and a shape or vocabulary
that does not match the target's. The manifest's `draft_head` section records the source directory and
each file's sha256.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from optc.core.artifact import sha256_file
from optc.core.eagle import PREFIX, EagleHeadConfig
from optc.core.errors import InputError
from optc.core.formats import DTYPES, Format
from optc.core.ir import Graph, TensorInfo
from optc.core.store import TensorStore
from optc.frontend.passmanager import Pass, PassContext, PassResult
from optc.frontend.quant.blocks import tensor_entry

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
LAYER = "layers.0."


class ImportDraftHead(Pass):
    """Read an EAGLE-1 head checkpoint into the artifact's draft head."""

    @dataclass(frozen=True)
    class Options:
        path: str | None = field(default=None, metadata={
            "help": "the head's directory: config.json and model.safetensors or pytorch_model.bin"})

    def run(self, graph: Graph, store: TensorStore, ctx: PassContext) -> PassResult:
        if f"{PREFIX}.fc.weight" in graph.tensors:
            return PassResult(graph, store, changed=False, stats={"imported": 0})
        if self.options.path is None:
            raise InputError("import_draft_head needs path: the EAGLE checkpoint's directory")
        directory = Path(self.options.path)
        config_file = directory / "config.json"
        if not config_file.is_file():
            raise InputError(f"import_draft_head path {directory}: no config.json (an EAGLE checkpoint directory "
                             f"holds config.json and one of {', '.join(WEIGHT_FILES)})")
        try:
            hf = json.loads(config_file.read_text())
        except json.JSONDecodeError as e:
            raise InputError(f"{config_file}: not JSON ({e})") from None
        config = _head_config(graph, hf, config_file)
        weights_file = next((directory / f for f in WEIGHT_FILES if (directory / f).is_file()), None)
        if weights_file is None:
            raise InputError(f"import_draft_head path {directory}: none of {', '.join(WEIGHT_FILES)}")
        weights = _head_weights(_read(weights_file), config, bool(hf.get("bias", True)), weights_file)
        dtype = graph.config.dtype
        new = graph.copy()
        entries = {}
        for name, w in weights.items():
            new.tensors[name] = TensorInfo(tuple(w.shape), Format(dtype=dtype))
            entries[name] = tensor_entry(w.to(DTYPES[dtype]).contiguous())
        files = {f.name: sha256_file(f) for f in (config_file, weights_file)}
        section = {"method": "eagle-1 import", "config": config.to_json(),
                   "source": {"path": str(directory.resolve()), "sha256": files}}
        return PassResult(new, store.with_entries(entries), changed=True,
                          stats={"imported": 1, "source": str(directory), "sha256": files},
                          manifest={"draft_head": section})


def _head_config(graph: Graph, hf: dict, where: Path) -> EagleHeadConfig:
    """The head's shape from the checkpoint's config, checked against the target's."""
    c = graph.config
    if hf.get("num_hidden_layers", 1) != 1:
        raise InputError(f"{where}: num_hidden_layers {hf['num_hidden_layers']}; an EAGLE-1 head has 1")
    if "draft_vocab_size" in hf or "target_hidden_size" in hf:
        raise InputError(f"{where}: an EAGLE-3 head (draft_vocab_size / target_hidden_size); only EAGLE-1 "
                         "heads import")
    for key in ("rope_scaling", "qkv_bias"):
        if hf.get(key):
            raise InputError(f"{where}: {key} {hf[key]!r} is not supported; allowed: absent or null")
    try:
        hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        kv_heads = int(hf.get("num_key_value_heads", heads))
        config = EagleHeadConfig(hidden, heads, kv_heads, hidden // heads,  # as cnets1.py: no head_dim key
                                 int(hf["intermediate_size"]), float(hf.get("rms_norm_eps", 1e-6)),
                                 float(hf.get("rope_theta", 10000.0)), tuple(range(c.vocab_size)), input_norm=False)
    except KeyError as e:
        raise InputError(f"{where}: no {e.args[0]}") from None
    for key, head, target in (("hidden_size", hidden, c.hidden_size), ("vocab_size", hf.get("vocab_size"),
                                                                      c.vocab_size)):
        if head != target:
            raise InputError(f"{where}: {key} {head}; the target's is {target} (a head of another model)")
    return config


def _read(path: Path) -> dict[str, torch.Tensor]:
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a damaged or foreign file: name it
        raise InputError(f"{path}: unreadable as a checkpoint ({type(e).__name__}: {e})") from None


def _head_weights(state: dict[str, torch.Tensor], config: EagleHeadConfig, bias: bool,
                  where: Path) -> dict[str, torch.Tensor]:
    """optc's head tensors (float32) from EAGLE-1's names: q/k/v and gate/up concatenated, a zero fc bias
    where the checkpoint has none."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_heads * d, config.num_kv_heads * d
    attn, mlp = LAYER + "self_attn.", LAYER + "mlp."

    def get(key: str, shape: tuple[int, ...]) -> torch.Tensor:
        if key not in state:
            raise InputError(f"{where}: no tensor {key}; an EAGLE-1 head has fc.weight and {LAYER}* "
                             "(self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj, post_attention_layernorm)")
        if tuple(state[key].shape) != shape:
            raise InputError(f"{where}: {key} has shape {tuple(state[key].shape)}; its config.json says {shape}")
        return state[key].float()

    weights = {
        "fc.weight": get("fc.weight", (h, 2 * h)),
        "fc.bias": get("fc.bias", (h,)) if bias else torch.zeros(h),
        "qkv_proj.weight": torch.cat([get(f"{attn}q_proj.weight", (q, h)), get(f"{attn}k_proj.weight", (kv, h)),
                                      get(f"{attn}v_proj.weight", (kv, h))]),
        "o_proj.weight": get(f"{attn}o_proj.weight", (h, q)),
        "post_attention_layernorm.weight": get(f"{LAYER}post_attention_layernorm.weight", (h,)),
        "gate_up_proj.weight": torch.cat([get(f"{mlp}gate_proj.weight", (i, h)), get(f"{mlp}up_proj.weight", (i, h))]),
        "down_proj.weight": get(f"{mlp}down_proj.weight", (h, i)),
    }
    return {f"{PREFIX}.{k}": v for k, v in weights.items()}
