"""`.csv` data: the same arrays as `.npz` / `.jsonl`, and errors that name the line and the column."""

from __future__ import annotations

import csv

import numpy as np
import pytest

from ondevice import DataError, Manifest
from ondevice.datafiles import load_data
from ondevice.text import load_jsonl
from tests.ondevice.test_text import COMMANDS, _jsonl, text_artifacts  # noqa: F401 - the fixture


def _write(path, header, rows):  # type: ignore[no-untyped-def]
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def test_a_feature_csv_reads_like_the_npz(digits_artifacts, digits_data, tmp_path):
    test = digits_data["test"]
    names = Manifest.load(digits_artifacts).labels or [str(i) for i in range(10)]
    rows = [[repr(float(v)) for v in x] + [names[int(y)] if i % 2 else str(int(y))]
            for i, (x, y) in enumerate(zip(test["input"], test["labels"]))]  # fmt: skip
    path = _write(tmp_path / "test.csv", [f"pixel{i}" for i in range(64)] + ["label"], rows)
    data = load_data(path, digits_artifacts)
    np.testing.assert_array_equal(data["input"], test["input"])
    np.testing.assert_array_equal(data["labels"], test["labels"])


def test_a_text_csv_reads_like_the_jsonl(text_artifacts, tmp_path):  # noqa: F811
    path = _write(tmp_path / "t.csv", ["text", "label"], COMMANDS)
    expected = load_jsonl(_jsonl(tmp_path / "t.jsonl", COMMANDS), text_artifacts)
    data = load_data(path, text_artifacts)
    assert sorted(data) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(data[name], value)


@pytest.mark.parametrize(
    "header, rows, message",
    [
        ([f"f{i}" for i in range(64)] + ["label"], [["0"] * 10 + ["x"] + ["0"] * 53 + ["3"]],
         r"t.csv:2: column 'f10' holds 'x', not a number"),
        ([f"f{i}" for i in range(63)] + ["label"], [["0"] * 63 + ["3"]],
         r"input 'input' takes 64 features per example \(64,\), the file has 63 feature columns"),
        ([f"f{i}" for i in range(64)] + ["intent"], [["0"] * 64 + ["3"]], r'expected a "label" column, found columns'),
        ([f"f{i}" for i in range(64)] + ["label"], [["0"] * 64 + ["12"]], r"t.csv:2: label 12 is not"),
    ],
)  # fmt: skip
def test_bad_csv_names_the_line_and_column(digits_artifacts, tmp_path, header, rows, message):
    with pytest.raises(DataError, match=message):
        load_data(_write(tmp_path / "t.csv", header, rows), digits_artifacts)


def test_an_unknown_format_lists_what_is_read(digits_artifacts, tmp_path):
    (tmp_path / "data.txt").write_text("1,2,3\n")
    with pytest.raises(DataError, match=r"data.txt is not an .npz archive .* odt reads \.npz .*, \.jsonl .* and \.csv"):
        load_data(tmp_path / "data.txt", digits_artifacts)
