"""`benchmarks.engines`' ExecuTorch column: its gradient check and how the table shows a row ExecuTorch cannot train.

(The run itself is a benchmark: it needs ExecuTorch's own directory and takes tens of minutes.)"""

from __future__ import annotations

import pytest
import torch

from benchmarks.engines import markdown
from benchmarks.executorch import Refused, _check_gradients


def test_the_gradient_check_names_the_first_wrong_parameter():
    expected = {"0.weight": torch.full((3, 3), 0.01), "0.bias": torch.tensor([0.5, -0.25])}
    right = {"net.0.weight": expected["0.weight"] * (1 + 1e-5), "net.0.bias": expected["0.bias"].clone()}
    _check_gradients(right, expected)  # within float32 roundings: accepted
    noise = {"k.bias": torch.tensor([3e-10, -1e-10])}  # zero in exact arithmetic (attention's key bias)
    _check_gradients({"net.k.bias": torch.tensor([-4e-10, 2e-10])}, noise)
    wrong = {**right, "net.0.weight": expected["0.weight"] + 2.0}
    with pytest.raises(Refused, match=r"gradient of 0\.weight is off by up to 2 where its largest value is 0\.01"):
        _check_gradients(wrong, expected)
    with pytest.raises(Refused, match="1 gradients where PyTorch has 2"):
        _check_gradients({"net.0.bias": right["net.0.bias"]}, expected)


def _row(model: str, executorch: float | None, refused: str | None) -> dict:  # type: ignore[type-arg]
    ms = {"portable": 1.0, "classic": 1.2, "torch": 2.0, **({"executorch": 30.0} if executorch else {})}
    return {"model": model, "batch": 8, "step_ms": ms, "portable_vs_classic": 1.2, "portable_vs_torch": 2.0,
            "classic_vs_torch": 1.67, "portable_vs_executorch": executorch, "executorch_refused": refused,
            "peak_rss_mib": {"portable": 70, "classic": 68, "torch": 300},
            "load_s": {"portable": 0.1, "classic": 0.1}}  # fmt: skip


def test_the_table_gives_executorch_ratios_and_says_why_a_row_has_none():
    result = {"machine": {"cpu": "AMD EPYC", "cores": 2}, "threads": 2,
              "versions": {"portable": "1.32.0", "classic": "1.19.2", "torch": "2.13.0", "executorch": "1.5.1"},
              "rows": [_row("MLP", 29.5, None),
                       _row("CNN", None, "trains wrongly: the gradient of 0.weight ...")]}  # fmt: skip
    table = markdown(result)
    assert "ExecuTorch 1.5.1" in table and "AMD EPYC (2 cores)" in table
    cells = [line.split(" | ") for line in table.splitlines() if "| 8 |" in line]
    lines = {row[0].removeprefix("| "): row for row in cells}
    assert lines["MLP"][5] == "30.00" and lines["MLP"][8] == "29.50x"
    assert lines["CNN"][5] == "-" and lines["CNN"][8] == "-"
    assert "- CNN: trains wrongly: the gradient of 0.weight ..." in table
    assert "- MLP" not in table
