"""build_datasets: the job's data section -> train/valid/test sources, for each data.source."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.data.blending import BlendedDataset
from engine.data.builder import build_datasets
from engine.data.gpt_dataset import GPTDataset
from engine.data.preprocess import preprocess
from engine.data.sources import SyntheticSource, TextSource
from engine.data.tokenizer import ByteTokenizer
from engine.jobspec import parse_job
from tests.engine.data_helpers import CORPUS

BYTE = ByteTokenizer()


def data(**section):
    return parse_job({"data": section}).data


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory):
    """Two preprocessed datasets: the shipped corpus, and its first quarter in a file of its own."""
    folder = tmp_path_factory.mktemp("indexed")
    quarter = folder / "quarter.txt"
    quarter.write_text(CORPUS.read_text()[: CORPUS.stat().st_size // 4])
    preprocess([CORPUS], "byte", folder / "corpus", progress=None)
    preprocess([quarter], "byte", folder / "quarter", progress=None)
    return folder / "corpus", folder / "quarter"


def test_synthetic_and_plain_text_keep_their_sources():
    synthetic = build_datasets(data(source="synthetic"), BYTE, 16, seed=1, synthetic_vocab_size=384)
    assert isinstance(synthetic.train, SyntheticSource) and synthetic.train.vocab_size == 384
    assert synthetic.valid is None and synthetic.test is None
    text = build_datasets(parse_job({}), BYTE, 16, seed=1)  # the default job: the shipped corpus
    assert isinstance(text.train, TextSource) and text.valid is None
    assert torch.equal(text.train[5], TextSource(None, BYTE, 16, 1)[5])


def test_text_with_a_split_samples_its_paragraphs():
    sets = build_datasets(data(source="text", split=[90, 5, 5]), BYTE, 32, seed=1)
    assert all(isinstance(s, GPTDataset) for s in (sets.train, sets.valid, sets.test))
    ranges = [s.doc_range for s in (sets.train, sets.valid, sets.test)]
    assert ranges[0][0] == 0 and ranges[0][1] == ranges[1][0] and ranges[1][1] == ranges[2][0]
    assert sets.train[0].shape == (33,) and sets.valid[10**6].shape == (33,)


def test_indexed_with_a_split_caches_next_to_the_data(prefixes):
    corpus, _ = prefixes
    sets = build_datasets(
        data(source="indexed", path=str(corpus), split="949,50,1"), BYTE, 64, seed=3, num_samples=(500, 20, 5)
    )
    train, valid, test = sets.train, sets.valid, sets.test
    assert train.num_samples == 500 and valid.num_samples == 20 and test.num_samples == 5
    docs = len(train.indexed)
    assert train.doc_range == (0, round(0.949 * docs)) and test.doc_range[1] == docs
    assert {p.name.split(".")[1] for p in corpus.parent.glob("corpus.*.npy")} == {"train", "valid", "test"}
    again = build_datasets(
        data(source="indexed", path=str(corpus), split="949,50,1"), BYTE, 64, seed=3, num_samples=(500, 20, 5)
    )
    assert again.train.cache_hit and torch.equal(again.train[123], train[123])


def test_indexed_without_a_split_trains_on_everything_and_honours_cache_dir(prefixes, tmp_path):
    corpus, _ = prefixes
    sets = build_datasets(
        data(source="indexed", path=str(corpus), cache_dir=str(tmp_path / "cache")), BYTE, 64, seed=3
    )
    assert sets.valid is None and sets.test is None
    assert sets.train.doc_range == (0, len(sets.train.indexed))
    assert len(list((tmp_path / "cache").glob("corpus.train.*.npy"))) == 3


def test_blend_mixes_in_exact_proportions_per_split(prefixes):
    corpus, quarter = prefixes
    spec = data(blend=[[3, str(corpus)], [1, str(quarter)]], split=[98, 2, 0])
    sets = build_datasets(spec, BYTE, 64, seed=7, num_samples=(4000, 40, None))
    assert isinstance(sets.train, BlendedDataset) and isinstance(sets.valid, BlendedDataset)
    assert sets.test is None
    assert len(sets.train) == 4000
    sets.train[3999]  # reading a sample builds the blend up to it
    counts = np.bincount(sets.train.dataset_index[:4000], minlength=2)
    assert abs(counts[0] - 3000) <= 1 and abs(counts[1] - 1000) <= 1
    d, k = int(sets.train.dataset_index[77]), int(sets.train.dataset_sample_index[77])
    assert torch.equal(sets.train[77], sets.train.datasets[d][k])
    # The validation blend draws on each dataset's validation documents only.
    assert [p.split for p in sets.valid.datasets] == ["valid", "valid"]


def test_missing_data_and_a_mismatched_tokenizer_are_clear(prefixes, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"^data\.path: no indexed dataset at .*elastron preprocess"):
        build_datasets(data(source="indexed", path=str(tmp_path / "nope")), BYTE, 8, seed=0)
    with pytest.raises(FileNotFoundError, match=r"^data\.blend: no indexed dataset at .*nope"):
        build_datasets(data(blend=[[1, str(prefixes[0])], [1, str(tmp_path / "nope")]]), BYTE, 8, seed=0)

    class BigVocab(ByteTokenizer):
        vocab_size = 100_000

    with pytest.raises(ValueError, match=r"holds uint16 ids but data\.tokenizer has 100000 ids"):
        build_datasets(data(source="indexed", path=str(prefixes[0])), BigVocab(), 8, seed=0)
    with pytest.raises(FileNotFoundError, match=r"^data\.path: no such file"):
        build_datasets(data(source="text", path=str(tmp_path / "x.txt"), split=[1, 1]), BYTE, 8, seed=0)


def test_a_split_too_small_for_one_sample_says_which(prefixes):
    with pytest.raises(
        ValueError, match=r"the test split of .*corpus has .* fewer than model\.seq_length \+ 1"
    ):
        build_datasets(data(source="indexed", path=str(prefixes[0]), split=[1921, 0, 2]), BYTE, 4096, seed=0)
