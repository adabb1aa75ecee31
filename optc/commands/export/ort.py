"""The `ort` flavor: opset 21 plus the com.microsoft operators ONNX Runtime runs fastest.

- attention: GroupQueryAttention on (B, S, H * D) q/k/v with past/present (B, H_kv, T, D) tensors,
  `seqlens_k` = attention_mask.sum(-1) - 1 and `total_sequence_length` = T. ONNX Runtime's GQA
  takes a prompt after a past (S > 1 with P > 0) only at batch 1; decoding (S = 1) batches freely.
- rotary embedding: RotaryEmbedding (non-interleaved, as Llama) with position_ids and (P, D / 2)
  cos/sin caches computed by optc.core.rope (so rope scaling is the artifact's).
- residual add + RMSNorm: SkipSimplifiedLayerNormalization (its 4th output is the sum).
- int4 weights: MatMulNBits (bits 4, block = the group size, zero points when the format has them),
  `accuracy_level` 1: float32 activations, the arithmetic of optc's int4 reference.

Also writes `genai_config.json` (onnxruntime-genai's description of the decoder) beside the model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from onnx import TensorProto

from optc.commands.export.lower import PAST_KEY, PAST_VALUE, PRESENT_KEY, PRESENT_VALUE, Lowering
from optc.commands.export.onnx_builder import MS_DOMAIN, matmulnbits_inputs
from optc.core.formats import Format
from optc.core.ir import ModelConfig, Node
from optc.core.rope import GLOBAL

MATMULNBITS_ACCURACY_LEVEL = 1  # float32 activations


class OrtLowering(Lowering):
    flavor = "ort"

    def rope(self, x: str, num_heads: int, node: Node, base: str) -> str:
        cos, sin = self.rotary_caches(node.attrs.get("rope_table", GLOBAL))
        partial = node.attrs.get("rotary_dim")
        extra = {"rotary_embedding_dim": partial, "num_heads": num_heads} if partial else {}
        return self.b.op1("RotaryEmbedding", [x, "position_ids", cos, sin], MS_DOMAIN, base, interleaved=0, **extra)

    def attention(self, q: str, k: str, v: str, node: Node) -> str:
        a, b, layer = node.attrs, self.b, node.attrs["layer"]
        seqlens = self.once("seqlens_k", self._seqlens_k)
        total = self.once("total_sequence_length", self._total_sequence_length)
        out, _, _ = b.op(
            "GroupQueryAttention",
            [q, k, v, PAST_KEY.format(layer), PAST_VALUE.format(layer), seqlens, total],
            [b.name(f"{node.name}/out"), PRESENT_KEY.format(layer), PRESENT_VALUE.format(layer)],
            MS_DOMAIN,
            node.name,
            num_heads=a["num_heads"],
            kv_num_heads=a["num_kv_heads"],
            scale=float(a["scale"]),
            **({"softcap": float(a["softcap"])} if a.get("softcap") else {}),
            **({"local_window_size": a["window"]} if a.get("window") else {}),  # the w keys up to the query
        )
        return out

    def add_rms_norm(self, x: str, residual: str, weight: str, eps: float, base: str) -> tuple[str, str]:
        normed, summed = self.b.name(f"{base}/normed"), self.b.name(f"{base}/sum")
        self.b.op("SkipSimplifiedLayerNormalization", [x, residual, weight], [normed, "", "", summed], MS_DOMAIN,
                  base, epsilon=float(eps))
        return normed, summed

    def int4_matmul(self, x: str, tensor: str, parts: dict[str, torch.Tensor], fmt: Format) -> str:
        n, k = self.graph.tensors[tensor].shape
        inputs = matmulnbits_inputs(self.b, tensor, parts, fmt)
        return self.b.op1("MatMulNBits", [x, *inputs], MS_DOMAIN, tensor, K=k, N=n, bits=4,
                          block_size=fmt.group_size, accuracy_level=MATMULNBITS_ACCURACY_LEVEL)

    def _seqlens_k(self) -> str:
        b = self.b
        total = b.op1("ReduceSum", ["attention_mask", b.const([1])], base="seqlens_k", keepdims=0)
        return b.op1("Cast", [b.op1("Sub", [total, b.const(1)], base="seqlens_k")], base="seqlens_k",
                     to=TensorProto.INT32)

    def _total_sequence_length(self) -> str:
        b = self.b
        t = b.op1("Gather", [b.op1("Shape", ["attention_mask"], base="total"), b.const(1)], base="total", axis=0)
        return b.op1("Cast", [t], base="total", to=TensorProto.INT32)  # a scalar


def write_genai_config(out: Path, cfg: ModelConfig, model_file: str, tokenizer_config: dict) -> Path:
    """onnxruntime-genai's genai_config.json for this decoder (greedy search by default)."""
    eos = list(cfg.eos_token_ids) or [tokenizer_config.get("eos_token_id", 0)]
    pad = tokenizer_config.get("pad_token_id") or eos[0]
    context = cfg.max_position_embeddings
    config = {
        "model": {
            "bos_token_id": cfg.bos_token_id if cfg.bos_token_id is not None else eos[0],
            "context_length": context,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": model_file,
                "head_size": cfg.head_dim,
                "hidden_size": cfg.hidden_size,
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "position_ids": "position_ids",
                    "past_key_names": PAST_KEY.replace("{}", "%d"),
                    "past_value_names": PAST_VALUE.replace("{}", "%d"),
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": PRESENT_KEY.replace("{}", "%d"),
                    "present_value_names": PRESENT_VALUE.replace("{}", "%d"),
                },
                "num_attention_heads": cfg.num_heads,
                "num_hidden_layers": cfg.num_layers,
                "num_key_value_heads": cfg.num_kv_heads,
            },
            "eos_token_id": eos if len(eos) > 1 else eos[0],
            "pad_token_id": pad,
            "type": "llama",
            "vocab_size": cfg.vocab_size,
        },
        "search": {
            "diversity_penalty": 0.0, "do_sample": False, "early_stopping": True, "length_penalty": 1.0,
            "max_length": context, "min_length": 0, "no_repeat_ngram_size": 0, "num_beams": 1,
            "num_return_sequences": 1, "past_present_share_buffer": False, "repetition_penalty": 1.0,
            "temperature": 1.0, "top_k": 1, "top_p": 1.0,
        },
    }
    path = out / "genai_config.json"
    path.write_text(json.dumps(config, indent=1) + "\n")
    return path
