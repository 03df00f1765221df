"""Tokenised documents in ArrayRecord shards, written by experiments.prepare_data, read to train.

Layout of an output directory:
  train-00000.array_record ...        one record per document: its text tokens (no BOS/EOS) as
  validation-00000.array_record ...   little-endian `token_dtype` bytes
  metadata.json                       tokenizer, vocabulary, shards and per-split counts; written
                                      last, so its presence marks a complete directory
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib

import numpy as np
from array_record.python.array_record_module import ArrayRecordWriter
import grain

from hybridmoe.data import sources
from hybridmoe.data.tokenizer import make_tokenizer, token_dtype

FORMAT = "hybridmoe.array_record.v1"
METADATA = "metadata.json"


class _SplitWriter:
    """Writes one split's documents to shards of at most `records_per_shard` records."""

    def __init__(self, out: pathlib.Path, split: str, records_per_shard: int, dtype: np.dtype):
        self.out, self.split, self.limit, self.dtype = out, split, records_per_shard, dtype
        self.shards: list[dict] = []
        self.writer = None
        self.documents = self.tokens = self.bytes = 0
        self.byte_counts = np.zeros(256, np.int64)

    def write(self, ids: np.ndarray, data: bytes) -> None:
        if self.writer is None or self.shards[-1]["records"] == self.limit:
            self.close()
            name = f"{self.split}-{len(self.shards):05d}.array_record"
            # group_size:1 keeps every record individually addressable (random access).
            self.writer = ArrayRecordWriter(str(self.out / name), "group_size:1")
            self.shards.append({"file": name, "records": 0})
        self.writer.write(ids.astype(self.dtype).tobytes())
        self.shards[-1]["records"] += 1
        self.documents += 1
        self.tokens += len(ids)
        self.bytes += len(data)
        self.byte_counts += np.bincount(np.frombuffer(data, np.uint8), minlength=256)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def summary(self, skipped: int) -> dict:
        return {"shards": self.shards, "documents": self.documents, "tokens": self.tokens,
                "bytes": self.bytes, "byte_counts": self.byte_counts.tolist(), "skipped": skipped}


def prepare_dataset(input_dir: str, output_dir: str, *, tokenizer: str = "bytes",
                    records_per_shard: int = 10_000, validation_fraction: float = 0.05,
                    skip_bad_records: bool = False) -> dict:
    """Tokenises the .txt/.jsonl documents under `input_dir` into shards; returns the metadata."""
    if not isinstance(records_per_shard, int) or records_per_shard <= 0:
        raise ValueError(f"records_per_shard must be a positive integer, got {records_per_shard!r}")
    if not 0.0 < validation_fraction <= 0.5:
        raise ValueError(f"validation_fraction must be in (0.0, 0.5], got {validation_fraction!r}")
    sources.input_files(input_dir)  # fail on a missing or empty input before touching the output
    out = pathlib.Path(output_dir)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"output_dir must be empty or absent (shards are never mixed), "
                         f"got {output_dir!r} with files in it")
    out.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(tokenizer)
    dtype = token_dtype(tok.vocab_size)
    writers = {s: _SplitWriter(out, s, records_per_shard, dtype) for s in sources.SPLITS}
    skipped = sources.SkipLog()
    try:
        for doc in sources.text_documents(input_dir, skip_bad_records=skip_bad_records,
                                          skipped=skipped):
            split = sources.split_of(doc.key, validation_fraction)
            writers[split].write(tok.encode(doc.text), doc.text.encode("utf-8"))
    except BaseException:
        for w in writers.values():  # leave the output empty, so a corrected rerun can use it
            w.close()
            for shard in w.shards:
                (out / shard["file"]).unlink(missing_ok=True)
        raise
    for w in writers.values():
        w.close()
    metadata = {
        "format": FORMAT,
        "tokenizer": tokenizer,
        "tokenizer_sha256": None if tokenizer == "bytes" else _sha256(tokenizer),
        "vocab_size": tok.vocab_size, "bos_id": tok.bos_id, "eos_id": tok.eos_id,
        "pad_id": tok.pad_id, "token_dtype": dtype.str,
        "validation_fraction": validation_fraction, "records_per_shard": records_per_shard,
        "skipped_records": len(skipped.keys), "skipped_examples": skipped.examples,
        "splits": {s: w.summary(skipped.count(s, validation_fraction)) for s, w in writers.items()},
    }
    (out / METADATA).write_text(json.dumps(metadata, indent=1))
    return metadata


def _sha256(path: str) -> str:
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


def read_metadata(path: str, tokenizer: str) -> dict:
    """metadata.json of a prepared directory, checked against DataConfig.tokenizer."""
    meta_path = os.path.join(path, METADATA)
    if not os.path.isfile(meta_path):
        raise ValueError(f"DataConfig.path must be a directory written by experiments.prepare_data "
                         f"(with {METADATA}), got {path!r}")
    meta = json.loads(pathlib.Path(meta_path).read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"DataConfig.path={path!r}: {METADATA} has format {meta.get('format')!r}, "
                         f"expected {FORMAT!r}")
    if (tokenizer == "bytes") != (meta["tokenizer"] == "bytes") or (
            tokenizer != "bytes" and _sha256_or_none(tokenizer) != meta["tokenizer_sha256"]):
        raise ValueError(f"DataConfig.tokenizer={tokenizer!r} is not the tokenizer the shards in "
                         f"{path!r} were written with ({meta['tokenizer']!r})")
    return meta


def _sha256_or_none(path: str) -> str | None:
    return _sha256(path) if os.path.isfile(path) else None


def read_split(path: str, meta: dict, split: str, *, skip_bad_records: bool
               ) -> tuple[list[np.ndarray], int]:
    """One split's documents (token arrays) through grain's ArrayRecordDataSource.

    A record whose length is not a whole number of tokens, or holding an id outside the text
    vocabulary [0, bos_id), raises naming shard and record, or is skipped and counted.
    Returns (documents, records skipped here plus those skipped by prepare_data).
    """
    shards = meta["splits"][split]["shards"]
    if not shards:
        raise ValueError(f"DataConfig.path={path!r}: the {split} split is empty (0 documents); "
                         f"add data or raise --validation_fraction in prepare_data")
    source = grain.sources.ArrayRecordDataSource([os.path.join(path, s["file"]) for s in shards])
    dtype, limit = np.dtype(meta["token_dtype"]), meta["bos_id"]
    ends = np.cumsum([s["records"] for s in shards])  # global index of each shard's end
    if len(source) != ends[-1]:
        raise ValueError(f"DataConfig.path={path!r}: the {split} shards hold {len(source)} "
                         f"records, {METADATA} says {ends[-1]}")
    docs, skipped = [], meta["splits"][split]["skipped"]
    for start in range(0, len(source), 1024):
        for k, raw in enumerate(source.__getitems__(range(start, min(start + 1024, len(source))))):
            ids = np.frombuffer(raw, dtype) if len(raw) % dtype.itemsize == 0 else None
            if ids is not None and (ids.size == 0 or (ids.min() >= 0 and ids.max() < limit)):
                docs.append(ids)
                continue
            g = start + k
            shard = int(np.searchsorted(ends, g, side="right"))
            file, index = shards[shard]["file"], g - (ends[shard - 1] if shard else 0)
            problem = ("is not a whole number of tokens" if ids is None
                       else f"holds token ids outside [0, {limit})")
            if not skip_bad_records:
                raise sources.BadRecordError(f"{os.path.join(path, file)}: record {index} "
                                             f"{problem}; {sources.SKIP_HINT}")
            skipped += 1
    return docs, skipped
