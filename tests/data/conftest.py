"""A small synthetic corpus of .txt and .jsonl files, prepared once into ArrayRecord shards."""

import pytest

from hybridmoe.config import DataConfig
from hybridmoe.data import prepare_dataset
from tests.data.corpus_utils import write_corpus


@pytest.fixture(scope="session")
def prepared(tmp_path_factory):
    """(shard directory, {key: text}) for the synthetic corpus, byte tokens, 7 records a shard."""
    src = tmp_path_factory.mktemp("corpus")
    docs = write_corpus(src)
    out = tmp_path_factory.mktemp("shards") / "out"
    prepare_dataset(str(src), str(out), records_per_shard=7,
                    validation_fraction=0.2)
    return out, docs


@pytest.fixture(scope="session")
def synthetic_config(prepared):
    return DataConfig(source="array_record", path=str(prepared[0]), seq_len=16, batch_size=4,
                      seed=3)
