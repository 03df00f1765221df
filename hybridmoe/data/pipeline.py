"""The training-data pipeline: grain datasets of packed rows, eval batches and the unigram baseline.

Batches are dicts of numpy arrays, [B, T] each (B = DataConfig.batch_size per process,
T = DataConfig.seq_len):
  tokens       int32    inputs
  targets      int32    tokens shifted by one (the next token of the stream)
  segment_ids  int32    documents numbered from 1 inside each row, 0 = padding
  loss_mask    float32  1 where the target belongs to its input's document, else 0
"""

from __future__ import annotations

import functools
import hashlib

import grain
import numpy as np

from hybridmoe.config import DataConfig
from hybridmoe.data.corpus import load_corpus
from hybridmoe.data.packing import num_rows, pack_rows

# Rows are packed per batch with vectorised numpy: two threads keep up with an accelerator, and a
# short buffer bounds host memory at large batch sizes.
READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=4)


def _check_shard(shard_index: int, shard_count: int) -> None:
    if not isinstance(shard_count, int) or shard_count <= 0:
        raise ValueError(f"shard_count must be a positive integer, got {shard_count!r}")
    if not isinstance(shard_index, int) or not 0 <= shard_index < shard_count:
        raise ValueError(f"shard_index must be in [0, shard_count={shard_count}), "
                         f"got {shard_index!r}")


def _shuffle_seed(seed: int) -> int:
    # grain shuffles epoch e with seed + e; hashing keeps runs with nearby seeds from sharing
    # permutations one epoch apart.
    return int.from_bytes(hashlib.sha256(f"train-rows:{seed}".encode()).digest()[:4], "big")


def train_dataset(config: DataConfig, *, shard_index: int = 0, shard_count: int = 1
                  ) -> grain.MapDataset:
    """Infinite MapDataset of train batches; this process's rows are r ≡ shard_index (mod count).

    Each epoch visits every row of the shard once, in an order drawn from DataConfig.seed and
    the epoch number; a batch may straddle two epochs.
    """
    _check_shard(shard_index, shard_count)
    corpus = load_corpus(config, "train")
    rows = num_rows(corpus.num_tokens, config.seq_len)
    if rows < shard_count:
        raise ValueError(f"DataConfig.seq_len={config.seq_len} gives the train split only {rows} "
                         f"rows, fewer than shard_count={shard_count}: lower seq_len or add data")
    ds = grain.MapDataset.range(rows)[shard_index::shard_count]
    ds = ds.shuffle(seed=_shuffle_seed(config.seed)).repeat()
    ds = ds.batch(config.batch_size, drop_remainder=True)
    return ds.map(functools.partial(pack_rows, corpus, seq_len=config.seq_len))


def make_train_iterator(config: DataConfig, *, shard_index: int = 0, shard_count: int = 1
                        ) -> grain.DatasetIterator:
    """Iterator over train batches; `get_state()` / `set_state()` save and restore its position.

    The state is a small JSON-able dict (the next batch index): store it with the checkpoint
    (grain.checkpoint.CheckpointSave / CheckpointRestore for Orbax).
    """
    ds = train_dataset(config, shard_index=shard_index, shard_count=shard_count)
    return iter(ds.to_iter_dataset(READ_OPTIONS))


def make_eval_batches(config: DataConfig, num_batches: int, *, shard_index: int = 0,
                      shard_count: int = 1) -> list[dict[str, np.ndarray]]:
    """A fixed list of validation batches, the same for every seed and run.

    Rows are spread evenly over the validation stream (so over all its documents). A small
    split gives fewer than `num_batches` batches (never a repeated row): the last one is filled
    with empty rows whose loss_mask is 0. Every process gets the same number of batches.
    """
    if not isinstance(num_batches, int) or num_batches <= 0:
        raise ValueError(f"num_batches must be a positive integer, got {num_batches!r}")
    _check_shard(shard_index, shard_count)
    corpus = load_corpus(config, "validation")
    rows = num_rows(corpus.num_tokens, config.seq_len)
    per_step = config.batch_size * shard_count
    steps = min(num_batches, -(-rows // per_step))
    used = min(steps * per_step, rows)
    chosen = np.full(steps * per_step, -1, np.int64)
    chosen[:used] = np.arange(used) * rows // used  # distinct, evenly spaced
    mine = chosen.reshape(steps, shard_count, config.batch_size)[:, shard_index]
    return [pack_rows(corpus, r, config.seq_len) for r in mine]


def unigram_bits_per_byte(config: DataConfig) -> float:
    """Bits per byte of a unigram byte model fit on train, scored on validation.

    The model predicts what the LM predicts: the documents' bytes and one EOS per document
    (add-one smoothing over 257 symbols); the total is divided by the validation text bytes,
    as the LM's bits-per-byte is. A trained model must beat this.
    """
    train, val = load_corpus(config, "train"), load_corpus(config, "validation")
    counts = np.append(train.byte_counts, train.num_documents) + 1.0
    log2_p = np.log2(counts / counts.sum())
    val_counts = np.append(val.byte_counts, val.num_documents)
    return float(-(val_counts * log2_p).sum() / val.num_bytes)


def bytes_per_token(config: DataConfig, split: str = "validation") -> float:
    """UTF-8 text bytes per loss-carrying target (text tokens and EOS) of a split.

    bits_per_byte = loss_nats_per_token / ln 2 / bytes_per_token; for byte tokens it is just
    under 1 (each document's EOS is a target but not a byte).
    """
    corpus = load_corpus(config, split)
    return corpus.num_bytes / corpus.num_loss_tokens
