"""Sources and shards: the stdlib corpus, prepare_data round trips, bad records, tokenizers."""

import dataclasses
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from array_record.python.array_record_module import ArrayRecordWriter

from hybridmoe.config import DataConfig
from hybridmoe.data import (BYTE_BOS_ID, BYTE_EOS_ID, BadRecordError, ByteTokenizer,
                            bytes_per_token, load_corpus, make_tokenizer, make_train_iterator,
                            prepare_dataset, sources, unigram_bits_per_byte)
from tests.data.corpus_utils import write_corpus

REPO = pathlib.Path(__file__).resolve().parents[2]


def documents_of(corpus):
    """The token documents of a corpus stream, BOS/EOS stripped."""
    ends = np.append(corpus.doc_starts[1:], corpus.num_tokens)
    return [corpus.tokens[s + 1:e - 1] for s, e in zip(corpus.doc_starts, ends)]


def test_stdlib_source_split_is_stable_and_disjoint():
    docs, skipped = sources.stdlib_documents()
    keys = [d.key for d in docs]
    assert len(docs) > 500 and keys == sorted(keys) and "os.py" in keys
    assert not any("site-packages" in k for k in keys)
    assert len(skipped.keys) < 20  # a few deliberately non-UTF-8 test files
    split = [sources.split_of(k, 0.05) for k in keys]
    assert split == [sources.split_of(k, 0.05) for k in keys]
    share = split.count("validation") / len(keys)
    assert 0.02 < share < 0.08
    cfg = DataConfig()
    train, val = load_corpus(cfg, "train"), load_corpus(cfg, "validation")
    assert train.num_documents + val.num_documents == len(docs)
    assert val.num_documents == split.count("validation")
    assert train.num_bytes > 5_000_000
    assert train.num_tokens == train.num_bytes + 2 * train.num_documents
    assert train.num_skipped + val.num_skipped == len(skipped.keys)
    # the validation stream holds exactly the validation files (so train holds none of them)
    val_texts = sorted(d.text.encode() for d, s in zip(docs, split) if s == "validation")
    assert sorted(d.astype(np.uint8).tobytes() for d in documents_of(val)) == val_texts
    bpb = unigram_bits_per_byte(cfg)
    assert 3.5 < bpb < 6.0, bpb
    assert bytes_per_token(cfg) == pytest.approx(1.0, abs=1e-3)
    batch = next(make_train_iterator(cfg))
    assert batch["tokens"].shape == (cfg.batch_size, cfg.seq_len)


def test_prepare_round_trip(prepared, synthetic_config):
    out, docs = prepared
    meta = json.loads((out / "metadata.json").read_text())
    fraction = meta["validation_fraction"]
    assert (meta["tokenizer"], meta["vocab_size"], meta["token_dtype"]) == ("bytes", 259, "<u2")
    for split in sources.SPLITS:
        texts = sorted(t for k, t in docs.items() if sources.split_of(k, fraction) == split)
        corpus = load_corpus(synthetic_config, split)
        assert texts and sorted(ByteTokenizer().decode(d) for d in documents_of(corpus)) == texts
        s = meta["splits"][split]
        assert s["documents"] == len(texts) == corpus.num_documents
        assert s["bytes"] == sum(len(t.encode()) for t in texts) == corpus.num_bytes
        assert [x["records"] for x in s["shards"]][:-1] == [7] * (len(s["shards"]) - 1)
        assert sum(x["records"] for x in s["shards"]) == len(texts)
        assert (corpus.tokens[corpus.doc_starts] == BYTE_BOS_ID).all()
        assert corpus.tokens[-1] == BYTE_EOS_ID and corpus.num_skipped == 0
    assert meta["skipped_records"] == 0


def test_prepare_data_command_line(tmp_path):
    write_corpus(tmp_path / "in", num_txt=2, num_jsonl=3)
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-m", "experiments.prepare_data",
                          f"--input_dir={tmp_path / 'in'}", f"--output_dir={tmp_path / 'out'}",
                          "--records_per_shard=2", "--validation_fraction=0.5"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    meta = json.loads((tmp_path / "out" / "metadata.json").read_text())
    assert sum(s["documents"] for s in meta["splits"].values()) == 5
    assert "train: " in run.stdout and "vocab_size=259" in run.stdout


def write_bad_corpus(root):
    (root / "sub").mkdir(parents=True)
    (root / "good.txt").write_text("fine text", encoding="utf-8")
    (root / "latin1.txt").write_bytes(b"line one\ncaf\xe9\n")
    (root / "sub" / "d.jsonl").write_bytes(b'{"text": "a"}\n{"txt": "b"}\n{"text": \n'
                                           b'{"text": "c\\ud800"}\n\xff\xfe\n{"text": "d"}\n')


@pytest.mark.parametrize("bad_file, message", [
    ("latin1.txt", r"latin1.txt:2: not valid UTF-8"),
    ("sub/d.jsonl", r"d.jsonl:2: needs a JSON object with a string field 'text'"),
])
def test_bad_record_names_file_and_line(tmp_path, bad_file, message):
    write_bad_corpus(tmp_path / "in")
    for other in ("latin1.txt", "sub/d.jsonl"):
        if other != bad_file:
            (tmp_path / "in" / other).unlink()
    with pytest.raises(BadRecordError, match=message + ".*skip_bad_records"):
        prepare_dataset(str(tmp_path / "in"), str(tmp_path / "out"))


def test_skip_bad_records_counts_them(tmp_path):
    write_bad_corpus(tmp_path / "in")
    with pytest.raises(BadRecordError, match="latin1.txt:2"):
        prepare_dataset(str(tmp_path / "in"), str(tmp_path / "out"))
    # the failed run left the output empty, so the corrected run can use it
    meta = prepare_dataset(str(tmp_path / "in"), str(tmp_path / "out"), skip_bad_records=True,
                           validation_fraction=0.5)
    # latin1.txt, and d.jsonl lines 2 (no text), 3 (bad JSON), 4 (lone surrogate), 5 (bytes)
    assert meta["skipped_records"] == 5
    assert sum(s["skipped"] for s in meta["splits"].values()) == 5
    assert sum(s["documents"] for s in meta["splits"].values()) == 3
    assert any("d.jsonl:3: invalid JSON" in m for m in meta["skipped_examples"])
    assert any("d.jsonl:5: not valid UTF-8" in m for m in meta["skipped_examples"])
    cfg = DataConfig(source="array_record", path=str(tmp_path / "out"))
    assert sum(load_corpus(cfg, s).num_skipped for s in sources.SPLITS) == 5


def test_corrupt_shard_record(prepared, tmp_path):
    out = tmp_path / "copy"
    out.mkdir()
    meta = json.loads((prepared[0] / "metadata.json").read_text())
    for name in os.listdir(prepared[0]):
        (out / name).write_bytes((prepared[0] / name).read_bytes())
    shard = meta["splits"]["train"]["shards"][1]
    writer = ArrayRecordWriter(str(out / shard["file"]), "group_size:1")
    for i in range(shard["records"]):
        writer.write(b"\x01" if i == 2 else b"\x01\x00")  # record 2: half a token
    writer.close()
    cfg = DataConfig(source="array_record", path=str(out))
    with pytest.raises(BadRecordError, match=shard["file"] + ": record 2 is not a whole number"):
        load_corpus(cfg, "train")
    skipping = load_corpus(dataclasses.replace(cfg, skip_bad_records=True), "train")
    assert skipping.num_skipped == 1


def test_bad_inputs_name_the_field(tmp_path, prepared):
    with pytest.raises(ValueError, match="input_dir must be an existing directory, got '/nonex"):
        prepare_dataset("/nonexistent/dir", str(tmp_path / "out"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="input_dir=.*empty' holds no .txt or .jsonl files"):
        prepare_dataset(str(tmp_path / "empty"), str(tmp_path / "out"))
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("text")
    with pytest.raises(ValueError, match="output_dir must be empty or absent.*with files in it"):
        prepare_dataset(str(tmp_path / "in"), str(prepared[0]))
    with pytest.raises(ValueError, match="records_per_shard must be a positive integer, got 0"):
        prepare_dataset(str(tmp_path), str(tmp_path / "out"), records_per_shard=0)
    with pytest.raises(ValueError, match="DataConfig.path must be a directory written by "
                                         "experiments.prepare_data.*got '/nonexistent'"):
        load_corpus(DataConfig(source="array_record", path="/nonexistent"), "train")
    with pytest.raises(ValueError, match="DataConfig.tokenizer must be 'bytes' or the path of a "
                                         r"tokenizers JSON file, got 'nope.json' \(no such file\)"):
        make_tokenizer("nope.json")
    with pytest.raises(ValueError, match="DataConfig.tokenizer=.*is not the tokenizer the shards"):
        load_corpus(DataConfig(source="array_record", path=str(prepared[0]),
                               tokenizer=str(tmp_path / "t.json")), "train")


def train_json_tokenizer(path):
    # pylint: disable-next=import-outside-toplevel
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["abc def ghij klmnop é→字"] * 20, trainer)
    tok.save(str(path))


def test_json_tokenizer(tmp_path):
    path = tmp_path / "tok.json"
    if importlib.util.find_spec("tokenizers") is None:
        path.write_text("{}")
        with pytest.raises(ImportError, match="needs the optional package `tokenizers`.*"
                                              "pip install tokenizers"):
            make_tokenizer(str(path))
        return
    train_json_tokenizer(path)
    tok = make_tokenizer(str(path))
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == tuple(
        tok.bos_id + i for i in range(4))
    ids = tok.encode("abc def é→字")
    assert ids.dtype == np.int32 and ids.max() < tok.bos_id and len(ids) < 12
    assert tok.decode(np.append(ids, tok.eos_id)) == "abc def é→字"
    docs = write_corpus(tmp_path / "in", num_txt=4, num_jsonl=10)
    prepare_dataset(str(tmp_path / "in"), str(tmp_path / "out"), tokenizer=str(path),
                    validation_fraction=0.5)
    cfg = DataConfig(source="array_record", path=str(tmp_path / "out"), tokenizer=str(path),
                     seq_len=8, batch_size=2)
    train = load_corpus(cfg, "train")
    assert train.vocab_size == tok.vocab_size and train.pad_id == tok.pad_id
    assert sorted(tok.decode(d) for d in documents_of(train)) == sorted(
        t for k, t in docs.items() if sources.split_of(k, 0.5) == "train")
    assert bytes_per_token(cfg) > 1.2  # merges: more than a byte per token
    assert next(make_train_iterator(cfg))["tokens"].max() < tok.vocab_size
    with pytest.raises(ValueError, match="DataConfig.tokenizer='bytes' is not the tokenizer"):
        load_corpus(dataclasses.replace(cfg, tokenizer="bytes"), "train")
