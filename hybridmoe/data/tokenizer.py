"""Tokenizers: bytes (the default) and a `tokenizers` JSON file, behind one interface.

Both put the three special tokens after the text vocabulary (BOS, EOS, PAD in that order), so
a text token is always `< bos_id` and a special id can never come out of `encode`.
"""

from __future__ import annotations

import os
from typing import Protocol, Sequence

import numpy as np

BYTE_BOS_ID = 256
BYTE_EOS_ID = 257
BYTE_PAD_ID = 258
BYTE_VOCAB_SIZE = 259


class Tokenizer(Protocol):
    name: str  # "bytes" or the JSON file's path: what DataConfig.tokenizer holds
    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> np.ndarray: ...  # [n] int32, text tokens only (no BOS/EOS)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]: ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str: ...  # special ids are dropped


class ByteTokenizer:
    """UTF-8 bytes are the tokens 0..255; 256 = BOS, 257 = EOS, 258 = PAD."""

    name = "bytes"
    vocab_size = BYTE_VOCAB_SIZE
    bos_id = BYTE_BOS_ID
    eos_id = BYTE_EOS_ID
    pad_id = BYTE_PAD_ID

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        ids = np.asarray(ids)
        return ids[ids < 256].astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class JsonTokenizer:
    """A Hugging Face `tokenizers` JSON file; BOS/EOS/PAD are three new ids after its vocabulary.

    The file's own special tokens (if any) are left alone: documents are delimited by our ids, so
    packing never depends on what a tokenizer calls its BOS.
    """

    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise ValueError(f"DataConfig.tokenizer must be 'bytes' or the path of a tokenizers "
                             f"JSON file, got {path!r} (no such file)")
        try:
            import tokenizers  # pylint: disable=import-outside-toplevel
        except ImportError as e:
            raise ImportError(f"DataConfig.tokenizer={path!r} needs the optional package "
                              f"`tokenizers`, not installed: pip install tokenizers") from e
        try:
            self._tok = tokenizers.Tokenizer.from_file(path)
        except Exception as e:  # the Rust library raises plain Exception subclasses
            raise ValueError(f"DataConfig.tokenizer={path!r} is not a readable tokenizers JSON "
                             f"file: {e}") from e
        self.name = path
        base = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_id, self.eos_id, self.pad_id = base, base + 1, base + 2
        self.vocab_size = base + 3

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, np.int32) for e in encodings]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        ids = np.asarray(ids)
        return self._tok.decode(ids[ids < self.bos_id].tolist(), skip_special_tokens=False)


def make_tokenizer(spec: str) -> Tokenizer:
    """`spec` is DataConfig.tokenizer: "bytes" or the path of a `tokenizers` JSON file."""
    return ByteTokenizer() if spec == "bytes" else JsonTokenizer(spec)


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest little-endian dtype that holds every id (halves memory and shards for bytes)."""
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<i4")
