"""The job's data section: tokenizer specs, data.blend and data.split shapes, checked at submit time.

Files are not opened here (the control plane may not see the ranks' disks): a blend prefix that
does not exist passes validation and fails on the ranks with a message naming data.blend.
"""

from __future__ import annotations

import pytest

from engine.jobspec import JobSpecError, parse_job


def parsed(**section):
    return parse_job({"data": section}).data


def refused(section: dict, pattern: str) -> str:
    with pytest.raises(JobSpecError, match=pattern) as info:
        parse_job({"data": section})
    return str(info.value)


def test_defaults_are_unchanged():
    d = parsed()
    assert (d.source, d.path, d.tokenizer, d.blend, d.split, d.cache_dir) == (
        "text",
        None,
        "byte",
        None,
        None,
        None,
    )


@pytest.mark.parametrize(
    "spec", ["byte", "hf:/models/gpt2/tokenizer.json", "hf:tok", "sentencepiece:/m/sp.model"]
)
def test_tokenizer_specs(spec):
    assert parsed(tokenizer=spec).tokenizer == spec


@pytest.mark.parametrize("spec", ["gpt2", "hf:", "spm:x.model", "sentencepiece"])
def test_bad_tokenizer_spec_names_the_field_and_the_forms(spec):
    refused(
        {"tokenizer": spec},
        r"^data\.tokenizer .* is not supported: use 'byte', 'hf:PATH' .* 'sentencepiece:PATH'",
    )


def test_indexed_needs_a_path():
    assert parsed(source="indexed", path="data/web").path == "data/web"
    refused(
        {"source": "indexed"},
        r"^data\.source indexed needs data\.path: the PREFIX given to `elastron preprocess",
    )


def test_blend_implies_its_source_and_keeps_the_pairs():
    d = parsed(blend=[[0.7, "data/web"], [3, "data/code"]])
    assert d.source == "blend" and [list(p) for p in d.blend] == [[0.7, "data/web"], [3.0, "data/code"]]
    assert parsed(source="blend", blend=[[1, "a"]]).source == "blend"
    # What the CLI and the REST API send back round-trips.
    again = parse_job(parse_job({"data": {"blend": [[1, "a"], [2, "b"]]}}).model_dump(mode="json"))
    assert again.data.source == "blend"


@pytest.mark.parametrize(
    "blend, pattern",
    [
        ([], r"data\.blend must be a non-empty list: write data\.blend as \[\[weight, prefix\], \.\.\.\]"),
        ("data/web", r"data\.blend must be a non-empty list"),
        ([[1, "a"], ["b", 1]], r"data\.blend\[1\]: the weight must be a positive number, got 'b'"),
        ([[0, "a"]], r"data\.blend\[0\]: the weight must be a positive number, got 0"),
        ([[-1, "a"]], r"data\.blend\[0\]: the weight must be a positive number"),
        ([[True, "a"]], r"data\.blend\[0\]: the weight must be a positive number, got True"),
        ([[1, ""]], r"data\.blend\[0\]: the prefix must be a non-empty string"),
        ([[1, "a", 2]], r"data\.blend\[0\] is \[1, 'a', 2\], not a \[weight, prefix\] pair"),
        (["a"], r"data\.blend\[0\] is 'a', not a \[weight, prefix\] pair"),
    ],
)
def test_bad_blend_shapes(blend, pattern):
    refused({"blend": blend}, pattern)


def test_blend_and_source_must_agree():
    refused(
        {"source": "text", "blend": [[1, "a"]]},
        r"data\.blend is set but data\.source is text: set data\.source to blend",
    )
    refused({"source": "blend"}, r"data\.source blend needs data\.blend")
    refused({"blend": [[1, "a"]], "path": "b"}, r"data\.path is not used with data\.source blend")


@pytest.mark.parametrize(
    "split, expected",
    [
        ("949,50,1", [949, 50, 1]),
        ("98, 1, 1", [98, 1, 1]),
        ([98, 1, 1], [98, 1, 1]),
        ([0.9, 0.1], [0.9, 0.1, 0]),
        ("100", [100, 0, 0]),
        ([1, 0, 0], [1, 0, 0]),
    ],
)
def test_split_forms(split, expected):
    assert parsed(source="indexed", path="p", split=split).split == expected


@pytest.mark.parametrize(
    "split, pattern",
    [
        ("a,b,c", r"data\.split 'a,b,c' is not a list of numbers: write data\.split as \"949,50,1\""),
        ([1, "x"], r"data\.split \[1, 'x'\] is not a list of numbers"),
        ([1, 1, 1, 1], r"data\.split has 4 shares: give 1 to 3"),
        ([1, -1, 0], r"data\.split shares must be non-negative numbers"),
        ([0, 1, 1], r"data\.split gives training no documents .* the first share must be positive"),
        (7, r"data\.split 7 is not a list of numbers"),
    ],
)
def test_bad_splits(split, pattern):
    refused({"source": "indexed", "path": "p", "split": split}, pattern)


def test_split_does_not_apply_to_synthetic_data():
    refused({"source": "synthetic", "split": [1, 1]}, r"data\.split does not apply to data\.source synthetic")


def test_misspelt_keys_get_a_suggestion():
    refused({"blends": [[1, "a"]]}, r"data\.blends: unknown key: did you mean 'blend'\?")
