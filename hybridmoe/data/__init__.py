"""Training data: tokenizers, document sources, packing into rows, and the grain pipeline.

Entry points: `make_train_iterator`, `make_eval_batches`, `unigram_bits_per_byte` and
`bytes_per_token`; `load_corpus` gives a split's counts (documents, tokens, bytes,
skipped records, vocabulary). Shards for `DataConfig.source="array_record"` are written by
`python -m experiments.prepare_data` (`prepare_dataset` here).
"""

from hybridmoe.data.corpus import Corpus, load_corpus
from hybridmoe.data.packing import long_document_windows, num_rows, pack_rows, pack_windows
from hybridmoe.data.pipeline import (bytes_per_token, make_eval_batches, make_train_iterator,
                                     train_dataset, train_row_starts, unigram_bits_per_byte)
from hybridmoe.data.records import prepare_dataset
from hybridmoe.data.sources import BadRecordError
from hybridmoe.data.tokenizer import (BYTE_BOS_ID, BYTE_EOS_ID, BYTE_PAD_ID, BYTE_VOCAB_SIZE,
                                      ByteTokenizer, JsonTokenizer, make_tokenizer)

__all__ = [
    "BYTE_BOS_ID", "BYTE_EOS_ID", "BYTE_PAD_ID", "BYTE_VOCAB_SIZE", "BadRecordError",
    "ByteTokenizer", "Corpus", "JsonTokenizer", "bytes_per_token", "load_corpus",
    "long_document_windows", "make_eval_batches", "make_tokenizer", "make_train_iterator",
    "num_rows", "pack_rows", "pack_windows", "prepare_dataset", "train_dataset",
    "train_row_starts", "unigram_bits_per_byte",
]
