"""The tokenizer as the token cache sees it: what identifies it (the cache key) and how
it travels to a cluster task cheaply.

`TokenizerFiles` keys the cache by the tokenizer folder's files, so a cache hit never
imports transformers; `ShippedTokenizer` sends only the Rust tokenizer to a Ray task.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from trainer.errors import UserError


def tokenizer_fingerprint(tokenizer: Any) -> str:
    if isinstance(tokenizer, TokenizerFiles):
        return tokenizer.fingerprint()
    h = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode())
    template = getattr(tokenizer, "chat_template", None) or ""
    h.update(f"|eos={tokenizer.eos_token_id}|tpl={template}".encode())
    return h.hexdigest()[:16]


_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")


class TokenizerFiles:
    """A tokenizer named by its files, loaded only when needed. The driver keys the token
    cache by these files (every file of the tokenizer folder but weights, the special
    tokens file) and the versions of the libraries that read them, which together fix the
    loaded tokenizer: so a cache hit (every resubmission, every job on data seen before)
    never imports transformers, ~4 s of the driver's start-up. A miss loads the tokenizer
    and tokenizes with it."""

    def __init__(self, folder: Path, special_tokens_file: str | None):
        self.folder, self.special_tokens_file = Path(folder), special_tokens_file
        self._loaded: Any = None

    def fingerprint(self) -> str:
        from importlib.metadata import version

        h = hashlib.sha256(b"files|")
        h.update(
            f"transformers={version('transformers')}|tokenizers={version('tokenizers')}".encode()
        )
        if not self.folder.is_dir():
            raise UserError(f"{self.folder}: cannot load a tokenizer: no such folder")
        for path in sorted(self.folder.iterdir()):
            if path.is_file() and not path.name.endswith(_WEIGHTS):
                h.update(f"|{path.name}|".encode())
                h.update(path.read_bytes())
        if self.special_tokens_file:
            h.update(b"|special|" + Path(self.special_tokens_file).read_bytes())
        return h.hexdigest()[:16]

    def load(self) -> Any:
        if self._loaded is None:
            from trainer.model.loading import load_tokenizer

            self._loaded = load_tokenizer(self.folder, self.special_tokens_file)
        return self._loaded


class ShippedTokenizer:
    """What encoding needs from a Hugging Face tokenizer, cheap to send to a cluster task:
    the Rust tokenizer (it pickles as its JSON), the EOS id, the chat template and the
    length. Unpickling the full tokenizer imports transformers, seconds of one CPU in every
    fresh worker process of every node; here that happens only if a chat row needs the
    template renderer (the full tokenizer rides along, pickled, for exactly that)."""

    def __init__(self, tokenizer: Any):
        import pickle

        self.backend_tokenizer = tokenizer.backend_tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.chat_template = getattr(tokenizer, "chat_template", None)
        self._len = len(tokenizer)
        self._full_pickle = pickle.dumps(tokenizer)
        self._full: Any = None

    def __len__(self) -> int:
        return self._len

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_full": None}

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        if self._full is None:
            import pickle

            self._full = pickle.loads(self._full_pickle)
        return self._full.apply_chat_template(*args, **kwargs)
