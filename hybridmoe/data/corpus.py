"""A split held in memory as one token stream, `BOS doc₀ EOS BOS doc₁ EOS ...`, plus its counts.

The whole split lives in host memory (uint16 for vocabularies up to 65,536: the 32 MB standard
library is 63 MB), which keeps row packing a matter of slicing one array.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import numpy as np

from hybridmoe.config import DataConfig
from hybridmoe.data import records, sources
from hybridmoe.data.tokenizer import make_tokenizer, token_dtype


@dataclasses.dataclass(frozen=True, eq=False)
class Corpus:
    tokens: np.ndarray  # [N] uint16|int32: BOS doc EOS BOS doc EOS ...
    doc_starts: np.ndarray  # [D] int64: position of each document's BOS, increasing from 0
    byte_counts: np.ndarray  # [256] int64: histogram of the documents' UTF-8 bytes
    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int
    num_skipped: int  # bad records of this split that were skipped (counted, not trained on)

    @property
    def num_documents(self) -> int:
        return len(self.doc_starts)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_bytes(self) -> int:
        return int(self.byte_counts.sum())

    @property
    def num_loss_tokens(self) -> int:
        """Targets that carry loss over an epoch: every token but the BOSes (text and EOS)."""
        return self.num_tokens - self.num_documents


def build_corpus(docs: Sequence[np.ndarray], *, byte_counts: np.ndarray, vocab_size: int,
                 bos_id: int, eos_id: int, pad_id: int, num_skipped: int = 0) -> Corpus:
    """Lays out token documents (text tokens only) as one BOS/EOS-delimited stream."""
    if not docs:
        raise ValueError("a split needs at least one document, got 0")
    lengths = np.fromiter((len(d) + 2 for d in docs), np.int64, len(docs))
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    tokens = np.empty(int(lengths.sum()), token_dtype(vocab_size))
    tokens[starts] = bos_id
    tokens[starts + lengths - 1] = eos_id
    for start, doc in zip(starts, docs):
        tokens[start + 1: start + 1 + len(doc)] = doc
    for array in (tokens, starts, byte_counts):
        array.flags.writeable = False  # shared through the cache below
    return Corpus(tokens, starts, byte_counts, vocab_size, bos_id, eos_id, pad_id, num_skipped)


def load_corpus(config: DataConfig, split: str) -> Corpus:
    """The `split` ("train" or "validation") of config's source, tokenised and laid out."""
    if split not in sources.SPLITS:
        raise ValueError(f"split must be one of {sources.SPLITS}, got {split!r}")
    return _load_corpus(config.source, config.path, config.tokenizer, config.validation_fraction,
                        config.skip_bad_records, split)


# Building the stdlib split takes a few seconds; train, eval and the unigram baseline share it.
@functools.lru_cache(maxsize=4)
def _load_corpus(source: str, path: str, tokenizer: str, validation_fraction: float,
                 skip_bad_records: bool, split: str) -> Corpus:
    if source == "stdlib":
        return _stdlib_corpus(tokenizer, validation_fraction, split)
    meta = records.read_metadata(path, tokenizer)
    docs, skipped = records.read_split(path, meta, split, skip_bad_records=skip_bad_records)
    byte_counts = np.asarray(meta["splits"][split]["byte_counts"], np.int64)
    return build_corpus(docs, byte_counts=byte_counts, vocab_size=meta["vocab_size"],
                        bos_id=meta["bos_id"], eos_id=meta["eos_id"], pad_id=meta["pad_id"],
                        num_skipped=skipped)


def _stdlib_corpus(tokenizer: str, validation_fraction: float, split: str) -> Corpus:
    docs, skipped = sources.stdlib_documents()
    texts = [d.text for d in docs if sources.split_of(d.key, validation_fraction) == split]
    tok = make_tokenizer(tokenizer)
    data = [t.encode("utf-8") for t in texts]
    if tok.name == "bytes":  # the bytes are the tokens: skip the int32 round trip
        ids = [np.frombuffer(b, np.uint8) for b in data]
    else:
        ids = tok.encode_batch(texts)
    byte_counts = np.bincount(np.frombuffer(b"".join(data), np.uint8), minlength=256)
    return build_corpus(ids, byte_counts=byte_counts.astype(np.int64), vocab_size=tok.vocab_size,
                        bos_id=tok.bos_id, eos_id=tok.eos_id, pad_id=tok.pad_id,
                        num_skipped=skipped.count(split, validation_fraction))
