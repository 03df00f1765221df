"""bench_kda names its result files after the card that measured them."""

import pytest

from experiments.bench_kda import result_name


@pytest.mark.parametrize("kind, name", [("NVIDIA H200", "kda_h200"), ("NVIDIA H100 80GB HBM3", "kda_h100"),
                                        ("NVIDIA GH200 480GB", "kda_gh200"), ("cpu", "kda_cpu")])
def test_result_files_are_named_after_the_card(kind, name):
    assert result_name(kind) == name
