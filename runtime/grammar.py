"""Structured outputs: a request's grammar (a JSON schema, a regex, a choice of strings, a Lark grammar) as a
matcher that says, before each output token, which tokens may come next.

The grammar engine is llguidance (docs/SERVE.md says why it was chosen over xgrammar): its Earley parser over
a lexer computes a token bitmask (one bit per vocabulary entry) from the output so far, consumes sampled tokens,
and rolls back, which speculative decoding needs. Nothing here parses JSON or regexes itself.

- `GrammarSpec` is what a request asks for (plain data, part of SamplingParams).
- `GrammarCompiler` turns specs into `Matcher`s for one tokenizer. Building a grammar's parser costs from
  tenths of a millisecond to hundreds (a large schema), so a bounded LRU keeps a pristine matcher per spec and
  every request starts from a deep copy of it. It is thread-safe: the server compiles off the engine thread. A
  spec llguidance refuses is an InputError naming the construct (the server's 400).
- `Masks` fills the bitmasks of a step's constrained rows on a worker thread while the model's forward runs
  (llguidance drops the GIL) where the forward leaves a core free, else just before it, and `masked` sets the
  logits of disallowed tokens to -inf afterwards, outside any captured CUDA graph. A speculative row's mask is
  the one after its drafts before it, so verification accepts only drafts the grammar allows.

The matcher consumes every output token the engine appends (an end-of-sequence token ends the request instead);
once the grammar is complete it allows only the end-of-sequence tokens, so a finished JSON value ends with
finish_reason "stop", and one cut by max_tokens with "length".
"""

from __future__ import annotations

import copy
import enum
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from optc.core.errors import InputError

DEFAULT_CACHE_SIZE = 256  # compiled grammars kept (a pristine matcher each: tens of kB to a few MB)
_BITS = torch.arange(32, dtype=torch.int32)


class GrammarKind(enum.StrEnum):
    JSON_SCHEMA = "json_schema"  # text: the schema's JSON ({"type": "object"}: any JSON object)
    REGEX = "regex"
    CHOICE = "choice"  # text: a JSON list of the strings allowed
    LARK = "lark"  # Lark, llguidance's dialect (%json {...} embeds a schema): forced tool calls
    GRAMMAR = "grammar"  # a client's grammar: that Lark, or GBNF / EBNF (llama.cpp's), converted to it


@dataclass(frozen=True)
class GrammarSpec:
    kind: GrammarKind
    text: str
    field: str = "structured_outputs"  # the request field a refusal names

    @staticmethod
    def json_schema(schema: dict[str, Any], field: str = "response_format") -> GrammarSpec:
        return GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema), field)


class GrammarCompiler:
    """Matchers for one tokenizer. `vocab_size`: the logits' width (rows past the tokenizer's entries are never
    allowed); `eos_token_ids`: the tokens that end a request, allowed where the grammar is complete."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        import llguidance.hf

        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        eos = list(eos_token_ids)
        if not eos:  # a model without one (random presets): llguidance needs one; this one is past the logits
            tokenizer = copy.deepcopy(tokenizer)
            tokenizer.add_special_tokens({"eos_token": "<|optc_grammar_end|>"})
            eos = [tokenizer.eos_token_id]
        self.num_mask_tokens = max(vocab_size, len(tokenizer))  # a bitmask's bits (tokens past the logits: never)
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.num_mask_tokens, eos_token=eos)
        self._cache: OrderedDict[tuple[GrammarKind, str], Any] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.num_compiled = 0  # cache misses (tests and metrics)

    def matcher(self, spec: GrammarSpec) -> Matcher:
        """A fresh matcher for `spec` (InputError naming spec.field where llguidance refuses it)."""
        import llguidance

        key = (spec.kind, spec.text)
        with self._lock:
            pristine = self._cache.get(key)
            if pristine is not None:
                self._cache.move_to_end(key)
                return Matcher(pristine.deep_copy(), self.num_mask_tokens)
        pristine = llguidance.LLMatcher(self._tokenizer, _grammar(spec), log_level=0)
        if pristine.is_error():
            raise InputError(f"'{spec.field}': the {spec.kind} grammar cannot be compiled: "
                             f"{_first_line(pristine.get_error())}", spec.field)
        with self._lock:
            self.num_compiled += 1
            self._cache[key] = pristine
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return Matcher(pristine.deep_copy(), self.num_mask_tokens)


class Matcher:
    """One request's grammar state: every output token so far consumed."""

    def __init__(self, matcher: Any, num_mask_tokens: int) -> None:
        self._matcher = matcher
        self.num_mask_tokens = num_mask_tokens

    def copy(self) -> Matcher:
        return Matcher(self._matcher.deep_copy(), self.num_mask_tokens)

    def consume(self, token_id: int) -> bool:
        """Advance over an emitted token; False where the grammar does not allow it."""
        return bool(self._matcher.consume_token(token_id))

    @property
    def is_complete(self) -> bool:
        """The grammar allows nothing more but the end of the sequence."""
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str:
        return self._matcher.get_error()

    def num_valid(self, token_ids: Sequence[int]) -> int:
        """How many of `token_ids`, in order, the grammar allows from here."""
        return int(self._matcher.validate_tokens(list(token_ids))) if token_ids else 0


class Masks:
    """Bitmasks of a step's constrained rows. `beside`: filled on a worker thread while the forward runs (where
    the forward leaves the host a core: a GPU's step, a CPU step on fewer threads than cores); else on the
    caller's thread just before the forward, as a third thread on cores whose every one runs the forward's
    OpenMP threads stalls their barriers for longer than the masks take (tens of microseconds a row)."""

    def __init__(self, beside: bool, num_threads: int = 1) -> None:
        import llguidance

        self.beside = beside
        self._executor = llguidance.LLExecutor(num_threads=num_threads)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="optc-grammar") if beside else None

    def start(self, rows: Sequence[tuple[Matcher, Sequence[Sequence[int]]]]) -> Future:
        """Begin filling the masks of a step's constrained requests, rows after rows: rows[i] = (matcher, the
        tokens before each of its rows past its output): a plain row's `[[]]`; a chain of drafts d1..dk's
        `[[], [d1], ..., [d1..dk]]`; a draft tree's root and each node's path. A row past a draft the grammar
        refuses stays all-allowed: verification rejects the refused draft first, so its token is never used.
        The future's result: (number of rows, W) int32 (already there where not `beside`)."""
        if self._worker is not None:
            return self._worker.submit(self._fill, list(rows))
        done: Future = Future()
        done.set_result(self._fill(list(rows)))
        return done

    def _fill(self, rows: list[tuple[Matcher, Sequence[Sequence[int]]]]) -> torch.Tensor:
        import llguidance.torch as lt

        shape = lt.get_bitmask_shape(sum(len(h) for _, h in rows), rows[0][0].num_mask_tokens)
        bitmask = torch.full(shape, -1, dtype=torch.int32)
        if len(rows) == 1 and len(rows[0][1]) == 1 and not list(rows[0][1][0]):  # one plain row: no executor
            lt.fill_next_token_bitmask(rows[0][0]._matcher, bitmask, 0)
            return bitmask
        plain, chains, row = [], [], 0
        for matcher, histories in rows:
            last = list(histories[-1])
            if not last:
                plain.append((matcher._matcher, row))
            elif all(list(h) == last[:i] for i, h in enumerate(histories)):  # a chain: llguidance walks its drafts
                chains.append((matcher._matcher, row, last))
            else:  # a tree: each node's path in turn, rolled back after its mask
                for i, path in enumerate(histories):
                    consumed = matcher._matcher.try_consume_tokens(list(path)) if path else 0
                    if consumed == len(path):
                        lt.fill_next_token_bitmask(matcher._matcher, bitmask, row + i)
                    if consumed:
                        matcher._matcher.rollback(consumed)
            row += len(histories)
        if plain:  # every matcher once: they run in parallel
            lt.fill_next_token_bitmask_par(self._executor, plain, bitmask)
        if chains:
            lt.fill_next_token_bitmask_par_with_draft_tokens(self._executor, chains, bitmask)
        return bitmask


def masked(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """A copy of `logits` with the tokens each row's bitmask leaves out at -inf.

    logits: (R, V) float; bitmask: (R, W) int32 on the CPU, bit j of word w = token 32 w + j allowed (tokens past
    32 W: never). On the CPU numpy unpacks the bits and copies the allowed logits, single-threaded: torch's
    element-wise ops over a 50k-token row fan out to OpenMP threads, which one busy core stalls for milliseconds.
    On CUDA (and for other dtypes) the words go to the device as they are (W = V / 32 a row, nothing syncs the
    stream) and unpack there."""
    rows, vocab_size = logits.shape
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        # little-endian words: byte 4w + k holds tokens 32w + 8k .. 32w + 8k + 7
        bits = np.unpackbits(bitmask.contiguous().numpy().view(np.uint8), axis=1, bitorder="little").view(bool)
        source = logits.detach().contiguous().numpy()
        out = np.full_like(source, -np.inf)
        width = min(vocab_size, bits.shape[1])
        np.copyto(out[:, :width], source[:, :width], where=bits[:, :width])
        return torch.from_numpy(out)
    words = bitmask.to(logits.device, non_blocking=True)
    allowed = ((words.unsqueeze(-1) >> _BITS.to(logits.device)) & 1).view(rows, -1).bool()
    if allowed.shape[1] < vocab_size:
        allowed = torch.cat([allowed, allowed.new_zeros(rows, vocab_size - allowed.shape[1])], dim=1)
    return torch.where(allowed[:, :vocab_size], logits, float("-inf"))


def _grammar(spec: GrammarSpec) -> str:
    import llguidance

    try:
        if spec.kind is GrammarKind.JSON_SCHEMA:
            # compact separators: a small model's free whitespace can run to max_tokens inside a valid value
            return llguidance.LLMatcher.grammar_from_json_schema(
                spec.text, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
        if spec.kind is GrammarKind.REGEX:
            return llguidance.LLMatcher.grammar_from_regex(spec.text)
        if spec.kind is GrammarKind.CHOICE:
            choices = json.loads(spec.text)
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
        if spec.kind is GrammarKind.LARK:
            return llguidance.LLMatcher.grammar_from_lark(spec.text)
        return llguidance.grammar_from("grammar", spec.text)  # Lark as it is; GBNF converted
    except ValueError as e:
        raise InputError(f"'{spec.field}': the {spec.kind} grammar cannot be read: {_first_line(str(e))}",
                         spec.field) from None


def _first_line(message: str) -> str:
    """llguidance's message on one line, at most 300 characters."""
    line = " ".join(message.split())
    return (line[:297] + "...") if len(line) > 300 else line or "no reason given"
