"""Tokenises .txt / .jsonl files into ArrayRecord shards for DataConfig.source="array_record".

  python -m experiments.prepare_data --input_dir=DIR --output_dir=OUT \
      [--tokenizer=bytes|path/to/tokenizer.json] [--records_per_shard=N] [--skip_bad_records]

A .txt file is one document; a .jsonl line is one document (its field "text"). Documents are
split into train and validation by a stable hash of their file path (and line). Then train with
DataConfig.source='array_record', DataConfig.path=OUT and the same DataConfig.tokenizer.
"""

from __future__ import annotations

from absl import app, flags

from hybridmoe.data.records import prepare_dataset

_INPUT_DIR = flags.DEFINE_string("input_dir", None, "Searched recursively for .txt and .jsonl.")
_OUTPUT_DIR = flags.DEFINE_string("output_dir", None, "Empty or new directory for shards.")
_TOKENIZER = flags.DEFINE_string("tokenizer", "bytes", '"bytes" or a tokenizers JSON file.')
_RECORDS_PER_SHARD = flags.DEFINE_integer("records_per_shard", 10_000, "Documents per shard.")
_VALIDATION_FRACTION = flags.DEFINE_float("validation_fraction", 0.05,
                                          "Share of documents in the validation split.")
_SKIP_BAD_RECORDS = flags.DEFINE_boolean("skip_bad_records", False,
                                         "Skip and count unreadable records instead of failing.")
flags.mark_flags_as_required(["input_dir", "output_dir"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    meta = prepare_dataset(_INPUT_DIR.value, _OUTPUT_DIR.value, tokenizer=_TOKENIZER.value,
                           records_per_shard=_RECORDS_PER_SHARD.value,
                           validation_fraction=_VALIDATION_FRACTION.value,
                           skip_bad_records=_SKIP_BAD_RECORDS.value)
    for split, s in meta["splits"].items():
        print(f"{split}: {s['documents']} documents, {s['tokens']} tokens, {s['bytes']} bytes, "
              f"{len(s['shards'])} shards, {s['skipped']} skipped")
    print(f"vocab_size={meta['vocab_size']} tokenizer={meta['tokenizer']!r} -> {_OUTPUT_DIR.value}")


if __name__ == "__main__":
    app.run(main)
