"""Synthetic retrieval rows in the training mixture (StageConfig.retrieval_share): the share, the
rows' content, determinism and resume, and that no evaluation example is trained on."""

import dataclasses
import json
import re

import numpy as np
import pytest

from hybridmoe import data as data_lib
from hybridmoe.config import RETRIEVAL_TASKS, DataConfig
from hybridmoe.data import retrieval
from hybridmoe.data.tokenizer import ByteTokenizer
from hybridmoe.eval import long_context as lc

CONFIG = DataConfig(seq_len=256, batch_size=8)
NIAH = ("niah_single", "niah_multikey")
NEEDLE = re.compile(r"\n(MAGIC_[A-Z]{6}) = (\d{7})\n")


def text(ids) -> str:
    return ByteTokenizer().decode([int(i) for i in ids if 0 <= i < 256])


def take(it, n):
    return [next(it) for _ in range(n)]


def test_tasks_are_the_evaluators():
    assert RETRIEVAL_TASKS == tuple(lc.TASKS)


def test_share_is_honoured_at_a_fixed_rhythm():
    corpus = data_lib.load_corpus(CONFIG, "train")
    items = data_lib.train_row_starts(CONFIG, corpus, retrieval_share=0.25)
    first = np.array([items[i] for i in range(400)])
    is_retrieval = first <= retrieval.RETRIEVAL_MARK
    assert is_retrieval.sum() == 100 and np.all(is_retrieval[3::4])  # every 4th row
    np.testing.assert_array_equal(retrieval.RETRIEVAL_MARK - first[is_retrieval], np.arange(100))
    plain = [data_lib.train_row_starts(CONFIG, corpus)[i] for i in range(300)]
    np.testing.assert_array_equal(first[~is_retrieval], plain)  # the packed stream, in order

    both = data_lib.train_row_starts(CONFIG, corpus, long_doc_share=0.5, retrieval_share=0.5)
    both = np.array([both[i] for i in range(100)])
    windows = data_lib.long_document_windows(corpus, CONFIG.seq_len)
    assert (both <= retrieval.RETRIEVAL_MARK).sum() == 50 and np.isin(both, windows).sum() == 50
    with pytest.raises(ValueError, match="retrieval_share must be at most 1 - long_doc_share"):
        data_lib.train_row_starts(CONFIG, corpus, long_doc_share=0.75, retrieval_share=0.5)


def test_batches_hold_answerable_retrieval_rows_with_loss_on_the_answer():
    batch = next(data_lib.make_train_iterator(CONFIG, retrieval_share=0.5, retrieval_tasks=NIAH))
    assert {k: v.shape for k, v in batch.items()} == {k: (8, 256) for k in batch}
    rows = [text(np.append(t, y[-1])) for t, y in zip(batch["tokens"], batch["targets"])]
    synthetic = [i for i, r in enumerate(rows) if re.search(r"\nassert MAGIC_[A-Z]{6} == ", r)]
    assert synthetic == [1, 3, 5, 7]
    for i in synthetic:
        key, value = re.search(r"\nassert (MAGIC_[A-Z]{6}) == (\d{7})\n$", rows[i]).groups()
        assert (key, value) in NEEDLE.findall(rows[i])  # the answer is the needle's value
        assert batch["tokens"][i, 0] == ByteTokenizer().bos_id
        assert np.all(batch["loss_mask"][i] == 1) and np.all(batch["segment_ids"][i] == 1)


def test_answer_weight_lands_on_the_answer_targets_only():
    plain = next(data_lib.make_train_iterator(CONFIG, retrieval_share=0.5, retrieval_tasks=NIAH))
    weighted = next(data_lib.make_train_iterator(CONFIG, retrieval_share=0.5, retrieval_tasks=NIAH,
                                                 retrieval_answer_weight=8.0))
    for key in ("tokens", "targets", "segment_ids"):
        np.testing.assert_array_equal(plain[key], weighted[key])
    for i in range(8):
        heavy = np.flatnonzero(weighted["loss_mask"][i] != plain["loss_mask"][i])
        if i % 2 == 0:  # stream rows: untouched
            assert heavy.size == 0
            continue
        row = text(np.append(plain["tokens"][i], plain["targets"][i, -1]))
        value = re.search(r"\nassert MAGIC_[A-Z]{6} == (\d{7})\n$", row).group(1)
        # The weighted targets are the answer's 7 digits, each predicted from the token before
        # it (the query's last space, then the digits), as the evaluator scores them.
        assert text(weighted["targets"][i, heavy]) == value
        assert text(weighted["tokens"][i, heavy[:1]]) == " "
        np.testing.assert_array_equal(heavy, np.arange(heavy[0], heavy[0] + 7))
        np.testing.assert_array_equal(weighted["loss_mask"][i, heavy], 8.0)
        assert heavy[-1] == CONFIG.seq_len - 2  # the newline after it is the row's last target
    with pytest.raises(ValueError, match="retrieval_answer_weight must be positive"):
        data_lib.make_train_iterator(CONFIG, retrieval_share=0.5, retrieval_answer_weight=0.0)


def test_rows_are_deterministic_seeded_and_resume_bitwise():
    make = lambda cfg: data_lib.make_train_iterator(cfg, retrieval_share=0.5, retrieval_tasks=NIAH)
    a, b = take(make(CONFIG), 3), take(make(CONFIG), 3)
    for x, y in zip(a, b):
        for key in x:
            np.testing.assert_array_equal(x[key], y[key])
    other = next(make(dataclasses.replace(CONFIG, seed=1)))["tokens"]
    assert not np.array_equal(other[1::2], a[0]["tokens"][1::2])

    it = make(CONFIG)
    take(it, 2)
    state = json.loads(json.dumps(it.get_state()))
    expected = take(it, 2)
    restored = make(CONFIG)
    restored.set_state(state)
    for want, got in zip(expected, take(restored, 2)):
        for key in want:
            np.testing.assert_array_equal(want[key], got[key])


def test_shards_draw_disjoint_retrieval_rows():
    corpus = data_lib.load_corpus(CONFIG, "train")
    ids = [[int(retrieval.RETRIEVAL_MARK - x) for x in (lambda ds: [ds[i] for i in range(40)])(
        data_lib.train_row_starts(CONFIG, corpus, retrieval_share=0.5, shard_index=s,
                                  shard_count=2)) if x <= retrieval.RETRIEVAL_MARK] for s in (0, 1)]
    assert ids == [list(range(0, 40, 2)), list(range(1, 40, 2))]


def test_no_evaluation_example_is_trained_on():
    """The benchmark grid (benchmarks/results/needle_tiny.md: seed 0, 20 examples, lengths 512 to
    32K) shares no needle and no filler source with the training rows of the tiny configs."""
    eval_haystack = lc.load_haystack(CONFIG)
    train_haystack = retrieval.train_haystack(CONFIG)
    # Different documents: the training haystack is the train split, the evaluator's validation.
    train_split = lc.haystack_from_corpus(data_lib.load_corpus(CONFIG, "train"),
                                          train_haystack.tokenizer)
    np.testing.assert_array_equal(train_haystack.tokens, train_split.tokens)
    assert len(train_haystack.tokens) != len(eval_haystack.tokens)

    eval_needles = set()
    for length in (512, 2048, 8192, 32768):
        for task in NIAH:
            for index in range(20):
                ex = lc.make_example(eval_haystack, task, length, 0.5, seed=0, index=index)
                eval_needles |= set(NEEDLE.findall(text(ex.prompt)))
                # The "train" stream at the very same arguments draws other keys and values.
                twin = lc.make_example(train_haystack, task, length, 0.5, seed=0, index=index,
                                       stream="train")
                assert not set(NEEDLE.findall(text(twin.prompt))) & eval_needles
    assert len(eval_needles) >= 4 * 20 * (1 + 4)  # single: 1 needle, multikey: 4 (all distinct)
    eval_keys = {k for k, _ in eval_needles}
    for seq_len in (512, 2048, 8192):
        for k in range(150):
            row = text(retrieval.retrieval_row(train_haystack, NIAH, seq_len, 0, k))
            needles = NEEDLE.findall(row)
            assert needles and not {key for key, _ in needles} & eval_keys


def test_stream_is_checked():
    haystack = retrieval.train_haystack(CONFIG)
    with pytest.raises(ValueError, match="stream must be one of eval, train, got 'test'"):
        lc.make_example(haystack, "niah_single", 256, 0.5, 0, stream="test")
    with pytest.raises(ValueError, match="StageConfig.retrieval_tasks must be a non-empty tuple"):
        data_lib.make_train_iterator(CONFIG, retrieval_share=0.5, retrieval_tasks=("x",))
