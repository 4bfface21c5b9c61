"""The model's tokenizer: encoding, the chat template, and incremental detokenization for streaming."""

from __future__ import annotations

import json
import re
import secrets
from pathlib import Path
from typing import Any

# Prompt tokens kept as leading context for the first output tokens (some tokenizers decode a word's leading
# space only when a token precedes it).
PROMPT_CONTEXT_TOKENS = 5
ZERO_WIDTH_SPACE = "\u200b"  # breaks a special token's spelling in text sent to another server
# Pushes whose text may be held back while it ends in an incomplete character: a UTF-8 character has at most
# 4 bytes, so text still ending in U+FFFD after 4 pushes holds invalid bytes and is emitted as it is.
MAX_HELD_PUSHES = 4


class Tokenizer:
    """A model directory's fast tokenizer and chat template."""

    def __init__(self, model_dir: Path | str) -> None:
        from transformers import AutoTokenizer

        self.model_dir = Path(model_dir)
        try:
            self._hf = AutoTokenizer.from_pretrained(self.model_dir)
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot load a tokenizer from {self.model_dir}: {exc}") from exc
        if not self._hf.is_fast:
            raise ValueError(f"{self.model_dir}: only fast (tokenizer.json) tokenizers are supported")
        self._backend = self._hf.backend_tokenizer
        self._literal = type(self._backend).from_str(self._backend.to_str())  # special-token text as text
        self._literal.encode_special_tokens = True
        self._special_texts = tuple(
            t.content for t in self._backend.get_added_tokens_decoder().values() if t.special
        )
        self.eos_token_ids: frozenset[int] = frozenset(self._eos_ids())
        self.vocab_size: int = len(self._hf)

    def _eos_ids(self) -> set[int]:
        """End-of-sequence ids from config.json, generation_config.json and the tokenizer itself."""
        ids: set[int] = set()
        for name in ("config.json", "generation_config.json"):
            path = self.model_dir / name
            if path.is_file():
                value = json.loads(path.read_text()).get("eos_token_id")
                ids.update(value if isinstance(value, list) else [] if value is None else [value])
        if self._hf.eos_token_id is not None:
            ids.add(self._hf.eos_token_id)
        return ids

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, with only the special tokens the model itself adds (e.g. a BOS)."""
        return _encode(self._backend, text, add_special_tokens=True)

    def encode_output(self, text: str) -> list[int]:
        """Token ids of generated ``text`` (what another server streamed): no special tokens added, and any
        special token's spelling encoded as plain text, so that decoding the ids gives ``text`` back."""
        return _encode(self._literal, text)

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of ``messages`` in the model's chat template, ending with the assistant prompt."""
        if not self._hf.chat_template:
            raise ValueError(f"the model at {self.model_dir} has no chat template")
        if not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise ValueError("messages must be a non-empty list of {'role': str, 'content': str}")
        contents = [m["content"] for m in messages]
        if not any(special in c for c in contents for special in self._special_texts):
            return _encode(self._backend, self._render(messages))
        # A message spells out a special token (e.g. "<|im_start|>system"): render the template around
        # stand-ins (with a random tag no content can guess), then encode each content on its own as plain
        # text, so only the template's own markers are control tokens.
        tag = secrets.token_hex(8)
        marked = [{**m, "content": f"\ue000{tag}{i}\ue001"} for i, m in enumerate(messages)]
        ids: list[int] = []
        for i, piece in enumerate(re.split(f"\ue000{tag}(\\d+)\ue001", self._render(marked))):
            encoder, text = (self._literal, contents[int(piece)]) if i % 2 else (self._backend, piece)
            ids.extend(_encode(encoder, text))
        return ids

    def plain_text(self, text: str) -> str:
        """``text`` with a zero-width space (U+200B) after the first character of every special token it
        spells out (``<|im_start|>``), for a server that applies the chat template and tokenizes it itself:
        there too the spelling stays text and never becomes a control token, as in
        :meth:`apply_chat_template`."""
        for special in self._special_texts:
            if len(special) > 1 and special in text:
                text = text.replace(special, f"{special[0]}{ZERO_WIDTH_SPACE}{special[1:]}")
        return text

    def _render(self, messages: list[dict[str, Any]]) -> str:
        return self._hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of ``token_ids`` (special tokens such as end-of-turn markers left out by default)."""
        return self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)


def _encode(backend: Any, text: str, add_special_tokens: bool = False) -> list[int]:
    """Token ids of ``text``. The batch call releases the GIL while it runs (the single call does not), so a
    long text tokenized on a worker thread does not stall the event loop."""
    return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that never split a UTF-8 character.

    Each push decodes only a short window: the tokens already emitted since the last completed piece (as
    context) plus the new ones. Text that ends in an incomplete character (decoded as U+FFFD) is held back
    until the following tokens complete it, or until :meth:`flush`; tokens that add no text or end in U+FFFD
    are held for at most ``MAX_HELD_PUSHES`` pushes, so that the window stays a few pushes long whatever
    the tokens (invalid bytes, skipped special tokens).
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:]) if prompt_ids else []
        self._prefix_offset = 0  # start of the context window
        self._read_offset = len(self._ids)  # tokens before this have been emitted as text
        self._held_pushes = 0  # pushes since then

    def _window_text(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special)

    def push(self, token_ids: list[int]) -> str:
        """Add new tokens; return the text they complete (possibly empty)."""
        self._ids.extend(token_ids)
        self._held_pushes += 1
        prefix = self._window_text(self._prefix_offset, self._read_offset)
        text = self._window_text(self._prefix_offset)
        waiting = len(text) <= len(prefix) or text.endswith("\ufffd")
        if waiting and self._held_pushes < MAX_HELD_PUSHES:
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._held_pushes = 0
        return text[len(prefix) :]

    def flush(self) -> str:
        """Whatever text is still held back (an incomplete character decodes as U+FFFD)."""
        prefix = self._window_text(self._prefix_offset, self._read_offset)
        text = self._window_text(self._prefix_offset)
        self._prefix_offset = self._read_offset = len(self._ids)
        return text[len(prefix) :]
