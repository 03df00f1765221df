"""Packing and the train/eval pipeline: row layout, exact epochs, determinism, restore, sharding."""

import dataclasses
import json

import numpy as np
import pytest

from hybridmoe.data import (BYTE_BOS_ID as BOS, BYTE_EOS_ID as EOS, BYTE_PAD_ID as PAD,
                            BYTE_VOCAB_SIZE, load_corpus, make_eval_batches, make_train_iterator,
                            num_rows, pack_rows, sources)
from hybridmoe.data.corpus import build_corpus


def tiny_corpus():
    docs = [np.array([1, 2, 3]), np.array([4, 5]), np.array([6, 7, 8, 9, 10])]
    return build_corpus(docs, byte_counts=np.zeros(256, np.int64), vocab_size=BYTE_VOCAB_SIZE,
                        bos_id=BOS, eos_id=EOS, pad_id=PAD)


def test_pack_rows_layout():
    # stream: B 1 2 3 E B 4 5 E B 6 7 8 9 10 E (16 tokens) -> ceil(15 / 6) = 3 rows
    corpus = tiny_corpus()
    assert num_rows(corpus.num_tokens, 6) == 3
    b = pack_rows(corpus, np.array([0, 1, 2, -1]), seq_len=6)
    np.testing.assert_array_equal(b["tokens"], [[BOS, 1, 2, 3, EOS, BOS], [4, 5, EOS, BOS, 6, 7],
                                                [8, 9, 10, EOS, PAD, PAD], [PAD] * 6])
    np.testing.assert_array_equal(b["targets"], [[1, 2, 3, EOS, BOS, 4], [5, EOS, BOS, 6, 7, 8],
                                                 [9, 10, EOS, PAD, PAD, PAD], [PAD] * 6])
    np.testing.assert_array_equal(b["segment_ids"], [[1, 1, 1, 1, 1, 2], [1, 1, 1, 2, 2, 2],
                                                     [1, 1, 1, 1, 0, 0], [0] * 6])
    np.testing.assert_array_equal(b["loss_mask"], [[1, 1, 1, 1, 0, 1], [1, 1, 0, 1, 1, 1],
                                                   [1, 1, 1, 0, 0, 0], [0] * 6])
    assert {k: (v.dtype.name, v.shape) for k, v in b.items()} == {
        "tokens": ("int32", (4, 6)), "targets": ("int32", (4, 6)),
        "segment_ids": ("int32", (4, 6)), "loss_mask": ("float32", (4, 6))}


def check_batch_invariants(b):
    tokens, targets, seg, mask = b["tokens"], b["targets"], b["segment_ids"], b["loss_mask"]
    np.testing.assert_array_equal(tokens[:, 1:], targets[:, :-1])  # targets shifted by one
    np.testing.assert_array_equal(seg == 0, tokens == PAD)  # padding is segment 0 ...
    np.testing.assert_array_equal(seg[:, 0], tokens[:, 0] != PAD)  # ... a row starts at 1 ...
    step, real = np.diff(seg, axis=1), seg[:, 1:] > 0
    assert np.isin(step[real], (0, 1)).all()  # ... and a new segment begins exactly at a BOS
    np.testing.assert_array_equal((step == 1) & real, tokens[:, 1:] == BOS)
    # no loss onto a BOS (the next document's start) or padding; loss everywhere else
    np.testing.assert_array_equal(mask == 0, (targets == BOS) | (targets == PAD))


def rows_of(batches):
    """Each row of each batch as a hashable tuple of its four fields."""
    keys = ("tokens", "targets", "segment_ids", "loss_mask")
    return [tuple(tuple(b[k][i]) for k in keys) for b in batches for i in range(len(b["tokens"]))]


def take(iterator, n):
    return [next(iterator) for _ in range(n)]


def test_epoch_holds_every_token_exactly_once(synthetic_config, prepared):
    cfg = synthetic_config
    corpus = load_corpus(cfg, "train")
    rows = num_rows(corpus.num_tokens, cfg.seq_len)
    reference = pack_rows(corpus, np.arange(rows), cfg.seq_len)
    # in order, the rows' inputs and targets are the stream, each token once (then padding)
    n = corpus.num_tokens
    inputs, targets = reference["tokens"].reshape(-1), reference["targets"].reshape(-1)
    np.testing.assert_array_equal(inputs[:n], corpus.tokens)
    np.testing.assert_array_equal(targets[:n - 1], corpus.tokens[1:])
    assert (inputs[n:] == PAD).all() and (targets[n - 1:] == PAD).all()
    # the stream holds exactly the train documents of the input files, each once
    texts = sorted(bytes(inputs[s + 1:e].astype(np.uint8)).decode()
                   for s, e in zip(np.flatnonzero(inputs == BOS), np.flatnonzero(inputs == EOS)))
    out, docs = prepared
    fraction = json.loads((out / "metadata.json").read_text())["validation_fraction"]
    expected = sorted(t for k, t in docs.items() if sources.split_of(k, fraction) == "train")
    assert texts == expected
    # two shuffled epochs from the iterator: each a permutation of the reference rows
    batches = take(make_train_iterator(cfg), -(-2 * rows // cfg.batch_size))
    for b in batches:
        check_batch_invariants(b)
    got = rows_of(batches)
    assert sorted(got[:rows]) == sorted(rows_of([reference]))
    assert sorted(got[rows:2 * rows]) == sorted(rows_of([reference]))
    assert got[:rows] != got[rows:2 * rows]  # reshuffled per epoch
    assert got[:rows] != rows_of([reference])  # shuffled at all


def test_same_seed_same_batches_other_seed_differs(synthetic_config):
    a = rows_of(take(make_train_iterator(synthetic_config), 5))
    b = rows_of(take(make_train_iterator(synthetic_config), 5))
    c = rows_of(take(make_train_iterator(dataclasses.replace(synthetic_config, seed=4)), 5))
    assert a == b
    assert a != c


def test_restored_iterator_continues_bitwise(synthetic_config):
    corpus = load_corpus(synthetic_config, "train")
    assert 32 * synthetic_config.batch_size > num_rows(corpus.num_tokens, synthetic_config.seq_len)
    it = make_train_iterator(synthetic_config)  # 7 + 25 batches cross an epoch boundary
    take(it, 7)
    state = json.loads(json.dumps(it.get_state()))  # what a checkpoint stores
    expected = take(it, 25)
    restored = make_train_iterator(synthetic_config)
    next(restored)  # a different position, overwritten by set_state
    restored.set_state(state)
    for want, got in zip(expected, take(restored, 25)):
        for key in want:
            np.testing.assert_array_equal(want[key], got[key])
            assert want[key].dtype == got[key].dtype


def test_shards_are_disjoint_and_cover_the_epoch(synthetic_config):
    cfg = synthetic_config
    corpus = load_corpus(cfg, "train")
    rows = num_rows(corpus.num_tokens, cfg.seq_len)
    everything = rows_of([pack_rows(corpus, np.arange(rows), cfg.seq_len)])
    assert len(set(everything)) == rows  # distinct rows, so equality of multisets is a partition
    shares = []
    for index in range(3):
        share_rows = len(range(index, rows, 3))
        it = make_train_iterator(cfg, shard_index=index, shard_count=3)
        shares.append(rows_of(take(it, -(-share_rows // cfg.batch_size)))[:share_rows])
    assert sorted(sum(shares, [])) == sorted(everything)
    with pytest.raises(ValueError, match=r"shard_index must be in \[0, shard_count=3\), got 3"):
        make_train_iterator(cfg, shard_index=3, shard_count=3)
    long = dataclasses.replace(cfg, seq_len=corpus.num_tokens)
    with pytest.raises(ValueError, match=f"DataConfig.seq_len={corpus.num_tokens} gives the train "
                                         "split only 1 rows, fewer than shard_count=2"):
        make_train_iterator(long, shard_count=2)


def test_eval_batches_fixed_disjoint_and_padded(synthetic_config):
    cfg = synthetic_config
    val = load_corpus(cfg, "validation")
    rows = num_rows(val.num_tokens, cfg.seq_len)
    full = make_eval_batches(cfg, 1000)  # more than the split holds: every row once, then padding
    assert len(full) == -(-rows // cfg.batch_size)
    got = rows_of(full)
    assert sorted(got[:rows]) == sorted(rows_of([pack_rows(val, np.arange(rows), cfg.seq_len)]))
    assert all(sum(r[3]) == 0 and set(r[0]) == {PAD} for r in got[rows:])
    for b in full:
        check_batch_invariants(b)
    two = rows_of(make_eval_batches(cfg, 2))
    assert len(set(two)) == 8 and set(two) <= set(got[:rows])
    assert rows_of(make_eval_batches(dataclasses.replace(cfg, seed=9), 2)) == two  # seed-free
    # two processes share one global batch of 8 rows: disjoint halves of it
    halves = [rows_of(make_eval_batches(cfg, 1, shard_index=i, shard_count=2)) for i in range(2)]
    whole = rows_of(make_eval_batches(dataclasses.replace(cfg, batch_size=8), 1))
    assert halves[0] + halves[1] == whole and not set(halves[0]) & set(halves[1])
    with pytest.raises(ValueError, match="num_batches must be a positive integer, got 0"):
        make_eval_batches(cfg, 0)
