"""Text in and out of the engine: prompts and chat messages to token ids, incremental
detokenization, and stop-string matching. The engine and the HTTP server both go through here.

Tokenization: a text prompt goes through the tokenizer, token ids pass as they are, and chat
messages go through the tokenizer's chat template with the generation prompt added
(`chat_token_ids`; transformers 5 returns a BatchEncoding, older versions a list, either of one
sequence or a batch of one: all read the same).

Incremental detokenization: each step decodes only a request's newest tokens.

A request's output text grows by a delta per step. Decoding the whole output every step would cost
O(output length) per token (O(n²) per request), so each request keeps two offsets into its output
token ids, as vLLM's detokenizer does:

    prefix = decode(ids[prefix_offset:read_offset])   # text already emitted, decoded again as context
    full   = decode(ids[prefix_offset:])
    delta  = full[len(prefix):]                        # when full grew and does not end mid-character

and then moves `prefix_offset, read_offset = read_offset, len(ids)`. Decoding a short window with one
token of context keeps tokenizers that treat a sequence's first token specially (SentencePiece's
leading space) right, because that token is in both decodes. A delta ending in U+FFFD is a character
whose bytes are split over tokens: nothing is emitted until the next token completes it (or the
window reaches `MAX_PENDING_TOKENS`, for text that really holds U+FFFD). The concatenated deltas
equal `decode(ids)`, for byte-level BPE tokenizers exactly.

Stop strings are searched in the new text only (plus the `max(len(stop)) - 1` characters before it),
so they too cost O(new text) per step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from optc.core.errors import InputError

REPLACEMENT = "\ufffd"
MAX_PENDING_TOKENS = 16  # a window this wide that still ends in U+FFFD is emitted as it is


def prompt_token_ids(tokenizer: Any, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
    """Token ids of a prompt: text through the tokenizer (as one user message with `chat`), or ids as they are."""
    if not isinstance(prompt, str):
        if chat:
            raise InputError("chat=True needs text prompts, got token ids")
        return [int(t) for t in prompt]
    if tokenizer is None:
        raise InputError("this engine has no tokenizer; pass token ids")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate: from a "\ud800" JSON escape, or argv that is not UTF-8
        raise InputError(f"the prompt holds a lone surrogate {prompt[e.start]!r} at index {e.start}: it is not "
                         "Unicode text, so no tokenizer takes it", "prompt") from None
    if chat:
        return chat_token_ids(tokenizer, [{"role": "user", "content": prompt}])
    return list(tokenizer(prompt)["input_ids"])


def chat_token_ids(tokenizer: Any, messages: Sequence[Mapping[str, Any]], **template_kwargs: Any) -> list[int]:
    """Token ids of chat messages through the tokenizer's chat template, ready for the reply (`template_kwargs`:
    more variables for the template, such as `tools`). A template that raises is an InputError quoting it."""
    if tokenizer is None:
        raise InputError("this artifact has no tokenizer, so it cannot format chat messages")
    if not getattr(tokenizer, "chat_template", None):
        raise InputError("this model's tokenizer has no chat template (a base model, not an instruction-tuned "
                         "one): send a plain prompt, or give a template with --chat-template FILE", "messages")
    from jinja2 import TemplateError

    try:
        ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True,
                                            **template_kwargs)
    except TemplateError as e:  # the template's own raise_exception("Conversation roles must alternate ...")
        raise InputError(f"the model's chat template refused these messages: {e}", "messages") from None
    if isinstance(ids, Mapping) or hasattr(ids, "input_ids"):  # transformers 5: a BatchEncoding
        ids = ids["input_ids"]
    if len(ids) and not isinstance(ids[0], int):  # a batch of one
        ids = ids[0]
    return [int(t) for t in ids]


class IncrementalDetokenizer:
    """The text of one request's output token ids, extended as tokens arrive."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.prefix_offset = 0
        self.read_offset = 0
        self.num_decoded_tokens = 0  # tokens passed to tokenizer.decode so far (a cost counter)

    def step(self, token_ids: Sequence[int], final: bool = False) -> str:
        """The text that the output `token_ids` (all of them, not only the new ones) add since the last
        call; `final` (the request ends) emits a split character as it is, as a one-shot decode would."""
        if self.tokenizer is None or len(token_ids) == self.read_offset:
            return ""
        prefix = self._decode(token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(token_ids[self.prefix_offset :])
        pending = len(token_ids) - self.prefix_offset
        is_split = full.endswith(REPLACEMENT) and pending < MAX_PENDING_TOKENS and not final
        if len(full) <= len(prefix) or is_split:
            return ""  # nothing new yet, or a character that the next token completes
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        return full[len(prefix) :]

    def _decode(self, token_ids: Sequence[int]) -> str:
        if not token_ids:
            return ""
        self.num_decoded_tokens += len(token_ids)
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=self.skip_special_tokens)


def find_stop(text: str, num_new_chars: int, stop: Sequence[str]) -> int | None:
    """Index of the earliest stop string that ends in the last `num_new_chars` characters of `text`
    (a stop string ending earlier was found in an earlier step), or None."""
    if not stop:
        return None
    start = max(0, len(text) - num_new_chars - max(len(s) for s in stop) + 1)
    found = [i for i in (text.find(s, start) for s in stop) if i >= 0]
    return min(found) if found else None


def held_back(text: str, stop: Sequence[str]) -> int:
    """How many trailing characters of `text` could still be the start of a stop string."""
    longest = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest
