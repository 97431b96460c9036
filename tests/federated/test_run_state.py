"""The saved state of a federated run: round trip, strategy state, damage and foreign artifacts refused."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.serverapp.strategy import FedAvgM

from federated.protocol import to_arrays
from federated.run_state import STATE_FILE, RunStateError, load_run_state, save_run_state


def _strategy() -> FedAvgM:
    strategy = FedAvgM(server_momentum=0.9)
    strategy.current_arrays = to_arrays({"w": np.arange(4, dtype=np.float32)})
    strategy.momentum_vector = [np.full(4, 0.5, np.float32)]
    return strategy


def test_round_trip_restores_the_model_rows_and_the_strategys_momentum(tmp_path):
    arrays = {"w": np.arange(4, dtype=np.float32), "bn.running_var": np.ones(2, np.float32)}
    rows = [{"round": 0, "central.accuracy": 0.1}, {"round": 1, "central.accuracy": 0.5}]
    save_run_state(tmp_path, server_round=1, arrays=arrays, strategy=_strategy(), rows=rows, manifest_sha256="a" * 64)
    fresh = FedAvgM(server_momentum=0.9)
    state = load_run_state(tmp_path, fresh, "a" * 64)
    assert state is not None and state.server_round == 1 and state.rows == rows
    for name, value in arrays.items():
        np.testing.assert_array_equal(state.arrays[name], value)
    np.testing.assert_array_equal(fresh.momentum_vector[0], np.full(4, 0.5, np.float32))
    np.testing.assert_array_equal(fresh.current_arrays["w"].numpy(), np.arange(4, dtype=np.float32))
    assert load_run_state(tmp_path / "none", fresh, "a" * 64) is None


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign"])
def test_a_damaged_or_foreign_state_is_refused(tmp_path, damage):
    save_run_state(tmp_path, server_round=3, arrays={"w": np.zeros(1000, np.float32)}, strategy=_strategy(), rows=[],
                   manifest_sha256="a" * 64)  # fmt: skip
    path = tmp_path / STATE_FILE
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x10
    elif damage == "truncate":
        data = data[: len(data) // 2]
    path.write_bytes(bytes(data))
    with pytest.raises(RunStateError):
        load_run_state(tmp_path, FedAvgM(), "b" * 64 if damage == "foreign" else "a" * 64)
