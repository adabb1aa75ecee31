"""Run an exported folder in ONNX Runtime (CPU): a session with the options the parity checks pin,
the feeds of one step, and a greedy loop that feeds `present` back as `past_key_values`.

Used by the export tests and benchmarks/export_onnx.py; the serving path of optc stays optc.runtime.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from optc.commands.export import MODEL_FILE
from optc.commands.export.lower import PAST_KEY, PAST_VALUE
from optc.core.ir import ModelConfig

# ONNX Runtime fuses DequantizeLinear + MatMul into MatMulNBits and, at its default accuracy level
# (4), quantizes the activations to int8 there; level 1 keeps them float32, as optc's reference.
FLOAT32_ACTIVATIONS = {"session.qdq_matmulnbits_accuracy_level": "1"}


def session(folder: Path, num_threads: int = 0, config: dict[str, str] | None = None):
    """An onnxruntime CPU InferenceSession for `folder/model.onnx` (0 threads = onnxruntime's default)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = num_threads
    for key, value in (FLOAT32_ACTIVATIONS if config is None else config).items():
        options.add_session_config_entry(key, value)
    return ort.InferenceSession(str(Path(folder) / MODEL_FILE), options, providers=["CPUExecutionProvider"])


def feeds(cfg: ModelConfig, input_ids: np.ndarray, past: list[np.ndarray] | None,
          attention_mask: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """One step's inputs: `input_ids` (B, S) after `past` (2 per layer, (B, H_kv, P, D)), positions P .. P + S - 1."""
    b, s = input_ids.shape
    p = past[0].shape[2] if past else 0
    mask = np.ones((b, p + s), np.int64) if attention_mask is None else attention_mask
    # positions count the attended tokens before each one (left padding gets position 0 onward)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)[:, p:]
    out = {"input_ids": input_ids.astype(np.int64), "attention_mask": mask, "position_ids": positions}
    empty = np.zeros((b, cfg.num_kv_heads, 0, cfg.head_dim), np.float32)
    for i in range(cfg.num_layers):
        out[PAST_KEY.format(i)] = past[2 * i] if past else empty
        out[PAST_VALUE.format(i)] = past[2 * i + 1] if past else empty
    return out


def greedy_generate(sess, cfg: ModelConfig, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens after `prompt_ids` (batch 1, EOS ignored): prefill once, then one token per step."""
    logits, *past = sess.run(None, feeds(cfg, np.array([prompt_ids]), None))
    tokens = [int(logits[0, -1].argmax())]
    while len(tokens) < max_tokens:
        logits, *past = sess.run(None, feeds(cfg, np.array([[tokens[-1]]]), past))
        tokens.append(int(logits[0, -1].argmax()))
    return tokens
