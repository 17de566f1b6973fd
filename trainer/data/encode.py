"""Rows → (token ids, loss mask): the settings that change the tokens, and the encoder.

Text rows are all loss. Chat rows (and prompt/completion, Alpaca and ShareGPT rows, which
the shapes turn into conversations) are rendered with the chat template, tool definitions
and calls included, and with loss_on=completion only the assistant turns (and the closing
EOS) are in the loss. An Alpaca row under a tokenizer without a chat template is the Alpaca
project's own prompt followed by the output, only the output in the loss.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainer.data.sources import Example
from trainer.errors import UserError

CACHE_VERSION = 4
"""3: every shard has a `.docs` array of document ends (document attention needs them).
4: rows are read by their shape (trainer.data.shapes): an Alpaca row is no longer read as
its `input` alone, so no cache of version 3 may be reused for it."""


@dataclass(frozen=True)
class Settings:
    """Everything besides the input bytes and the tokenizer that changes the tokens."""

    append_eos: bool = True
    on_bad_line: str = "error"
    loss_on: str = "completion"
    chat_template: str | None = None  # the template's text, not its path
    long_rows: str = "split"
    block_size: int = 1024
    endpoint: str | None = None
    region: str | None = None
    columns: tuple[tuple[str, str], ...] = ()  # data.columns of this source: (field, column)

    def key(self) -> str:
        # block_size only changes the tokens when long rows are dropped.
        block = self.block_size if self.long_rows == "drop" else 0
        tpl = hashlib.sha256((self.chat_template or "").encode()).hexdigest()[:16]
        cols = f"|cols={sorted(self.columns)}" if self.columns else ""
        return (
            f"eos={self.append_eos}|bad={self.on_bad_line}|loss={self.loss_on}|tpl={tpl}"
            f"|long={self.long_rows}:{block}{cols}|v{CACHE_VERSION}"
        )


def read_chat_template(value: str | None) -> str | None:
    """`data.chat_template` is a path to a Jinja file, or the template itself."""
    if value is None:
        return None
    if "{" not in value:
        path = Path(value).expanduser()
        if not path.is_file():
            raise UserError(f"data.chat_template {value}: file not found (or give the Jinja text)")
        return path.read_text()
    return value


class Encoder:
    """Rows → (token ids, loss mask or None when every token is in the loss)."""

    def __init__(self, tokenizer: Any, settings: Settings):
        self.tok = tokenizer
        self.backend = tokenizer.backend_tokenizer
        self.s = settings
        self.eos = tokenizer.eos_token_id if settings.append_eos else None
        self.template = settings.chat_template or getattr(tokenizer, "chat_template", None)

    def encode(self, examples: list[Example]) -> list[tuple[list[int], np.ndarray | None]]:
        out: list[tuple[list[int], np.ndarray | None]] = [([], None)] * len(examples)
        texts = [(i, e.text) for i, e in enumerate(examples) if e.text is not None]
        if texts:
            encs = self.backend.encode_batch_fast([t for _, t in texts], add_special_tokens=True)
            for (i, _), enc in zip(texts, encs, strict=True):
                out[i] = (self._eos(enc.ids), None)
        rest = [(i, e) for i, e in enumerate(examples) if e.text is None]
        # Without a chat template a row with a plain-text form (Alpaca) is that text, the
        # tokenizer's own special tokens (BOS) first; a template renders its own.
        for plain in (False, True):
            group = [(i, e) for i, e in rest if self._plain(e) == plain]
            if not group:
                continue
            rendered = [self._render_plain(e) if plain else self._render(e) for _, e in group]
            encs = self.backend.encode_batch([r[0] for r in rendered], add_special_tokens=plain)
            for (i, _), (_, spans), enc in zip(group, rendered, encs, strict=True):
                out[i] = self._masked(enc, spans)
        return out

    def _plain(self, example: Example) -> bool:
        return not self.template and example.fallback is not None

    def _masked(self, enc: Any, spans: list[tuple[int, int]]) -> tuple[list[int], Any]:
        ids = self._eos(enc.ids)
        if self.s.loss_on == "all":
            return ids, None
        mask = np.zeros(len(ids), dtype=np.uint8)
        for j, (start, end) in enumerate(enc.offsets):
            # a special token (BOS) has an empty span at 0: never an answer's
            mask[j] = end > start and any(a <= start < b for a, b in spans)
        if len(ids) > len(enc.ids):
            mask[-1] = 1  # the EOS we add closes the answer: the model learns to stop
        return ids, mask

    def _eos(self, ids: list[int]) -> list[int]:
        if self.eos is not None and (not ids or ids[-1] != self.eos):
            return [*ids, self.eos]
        return ids

    @staticmethod
    def _render_plain(example: Example) -> tuple[str, list[tuple[int, int]]]:
        assert example.fallback is not None
        prompt, completion = example.fallback
        return prompt + completion, [(len(prompt), len(prompt) + len(completion))]

    def _render(self, example: Example) -> tuple[str, list[tuple[int, int]]]:
        """The whole conversation, and the character spans of its assistant turns: a turn's
        span runs from the end of the prompt that asks for it (the conversation so far plus
        the generation prompt) to the end of the conversation rendered through it."""
        msgs = [dict(m) for m in example.messages]
        tools = [dict(t) for t in example.tools] if example.tools else None
        full = self._apply(msgs, False, tools)
        spans = []
        for k, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            before = self._apply(msgs[:k], True, tools) if k else ""
            through = self._apply(msgs[: k + 1], False, tools)
            if not (full.startswith(before) and full.startswith(through)):
                raise UserError(
                    "the chat template does not render a conversation's turns as prefixes of "
                    "the whole; set data.chat_template to one that does, or data.loss_on: all"
                )
            spans.append((len(before), len(through)))
        return full, spans

    def _apply(self, msgs: list[dict[str, Any]], gen: bool, tools: list[Any] | None) -> str:
        if not msgs:
            return ""
        if not self.template:
            raise UserError(
                "chat rows need a chat template: the tokenizer has none; set data.chat_template"
            )
        return self.tok.apply_chat_template(
            msgs,
            tools=tools,
            chat_template=self.template,
            tokenize=False,
            add_generation_prompt=gen,
        )
