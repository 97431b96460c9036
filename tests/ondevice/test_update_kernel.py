"""The native update kernel against the update graph it replaces, run by stock ONNX Runtime: the same bits on
every instruction set this CPU has, and a library that does not load or computes other bits is not used."""

from __future__ import annotations

import ctypes
import shutil

import numpy as np
import pytest

from artifacts.optimizers import SGD, AdamW
from artifacts.portable_optimizer import build_optimizer_graph
from ondevice.engines import update_kernel
from ondevice.engines.contract import OPTIMIZER_INPUTS, OPTIMIZER_STATE, OPTIMIZER_UPDATED
from ondevice.engines.portable import adamw_rates
from ondevice.session import OrtValue, ort


@pytest.fixture
def kernel():
    found = update_kernel.load()
    assert found is not None, update_kernel.status()
    yield found
    ctypes.CDLL(str(update_kernel.LIBRARY)).odt_limit_isa(2)


def _isas() -> list[int]:
    """Every instruction-set variant this CPU runs (0 baseline, 1 AVX2, 2 AVX-512)."""
    if not update_kernel.LIBRARY.is_file():
        return [0]  # the kernel fixture fails, saying why
    return list(range(ctypes.CDLL(str(update_kernel.LIBRARY)).odt_isa() + 1))


def _graph_update(optimizer, vectors, rates):  # type: ignore[no-untyped-def]
    """One run of the update graph over ``vectors`` (parameters, gradients, moments), in place."""
    model = build_optimizer_graph(optimizer, vectors[0].size, 17, 8)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    binding = session.io_binding()
    wanted = {i.name for i in session.get_inputs()}
    for name, value in zip(OPTIMIZER_INPUTS, rates):
        if name in wanted:
            binding.bind_ortvalue_input(name, OrtValue.ortvalue_from_numpy(np.array(value, np.float32)))
    for name, array in zip(OPTIMIZER_STATE, vectors):
        if name in wanted:
            binding.bind_ortvalue_input(name, OrtValue.ortvalue_from_numpy(array))
    outputs = {o.name for o in session.get_outputs()}
    for name, array in zip(OPTIMIZER_UPDATED, (vectors[0], *vectors[2:])):
        if name in outputs:
            binding.bind_ortvalue_output(name, OrtValue.ortvalue_from_numpy(array))
    session.run_with_iobinding(binding)


def _vectors(size: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    w, g, m = (rng.standard_normal(size).astype(np.float32) for _ in range(3))
    g *= np.float32(10.0) ** rng.integers(-6, 3, size).astype(np.float32)  # gradients over nine decades
    return [w, g, m * np.float32(0.01), np.abs(m) * np.float32(1e-4)]


OPTIMIZERS = {
    "adamw": AdamW(lr=1e-3, weight_decay=0.0),
    "adamw-decay": AdamW(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05),
    "sgd": SGD(lr=0.05),
}


@pytest.mark.parametrize("size", [1, 67, 262_147])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("isa", _isas())
def test_the_kernel_computes_the_update_graphs_bits(kernel, name, size, isa):
    """Five steps with fresh gradients each: parameters and moments equal to the graph's, bit for bit, on the
    baseline loop and on each wider variant the CPU has (a user's CPU may run any of them)."""
    ctypes.CDLL(str(update_kernel.LIBRARY)).odt_limit_isa(isa)
    optimizer = OPTIMIZERS[name]
    ours = _vectors(size, seed=size)
    theirs = [array.copy() for array in ours]
    for step in range(1, 6):
        ours[1][...] = theirs[1][...] = _vectors(size, seed=100 + step)[1]
        if optimizer.kind == "adamw":
            rates = adamw_rates(optimizer.lr, step, optimizer.betas, optimizer.weight_decay)
            kernel.adamw(*ours, betas=optimizer.betas, eps=optimizer.eps, lr_corrected=rates[1], lr_decay=rates[2])
        else:
            rates = (optimizer.lr, optimizer.lr, 0.0)
            kernel.sgd(ours[0], ours[1], lr=optimizer.lr)
        _graph_update(optimizer, theirs, rates)
    for mine, graph in zip(ours, theirs):
        np.testing.assert_array_equal(mine, graph)
    assert not np.array_equal(ours[0], _vectors(size, seed=size)[0])  # it moved


@pytest.mark.parametrize("optimizer", [AdamW(lr=1e-3, weight_decay=0.01, max_grad_norm=0.5), SGD(max_grad_norm=0.5)],
                         ids=["adamw", "sgd"])
def test_clipping_scales_the_gradients_as_the_clipping_graph_does(kernel, optimizer):
    """The norm over every gradient, in double (the graph sums float32 in its own order): the coefficient within
    a float32 rounding of the graph's, and so every value within a few roundings of the vector's largest (a
    moment whose two terms nearly cancel keeps the absolute difference, not the relative one)."""
    ours = _vectors(100_003, seed=7)
    theirs = [array.copy() for array in ours]
    coefficient = kernel.clip_coefficient(ours[1], 0.5)
    norm = np.sqrt(np.sum(ours[1].astype(np.float64) ** 2))
    assert coefficient == pytest.approx(0.5 / (norm + 1e-6), rel=1e-6) and coefficient < 0.01  # it binds
    assert kernel.clip_coefficient(ours[1] * np.float32(1e-9), 0.5) == 1.0  # a small gradient is left alone
    if optimizer.kind == "adamw":
        rates = adamw_rates(optimizer.lr, 1, optimizer.betas, optimizer.weight_decay)
        kernel.adamw(*ours, betas=optimizer.betas, eps=optimizer.eps, lr_corrected=rates[1], lr_decay=rates[2],
                     clip=coefficient)  # fmt: skip
    else:
        rates = (optimizer.lr, optimizer.lr, 0.0)
        kernel.sgd(ours[0], ours[1], lr=optimizer.lr, clip=coefficient)
    _graph_update(optimizer, theirs, rates)
    for mine, graph in zip(ours, theirs):
        np.testing.assert_allclose(mine, graph, rtol=1e-6, atol=1e-6 * np.abs(graph).max())


def test_the_kernel_refuses_vectors_it_cannot_update_in_place(kernel):
    w = np.zeros(8, np.float32)
    for bad in (np.zeros(8, np.float64), np.zeros(16, np.float32)[::2], np.zeros(7, np.float32)):
        with pytest.raises(ValueError, match="contiguous float32 vectors of one length"):
            kernel.sgd(w, bad, lr=0.1)


def test_a_library_that_is_absent_does_not_load_or_computes_other_bits_is_not_used(tmp_path, monkeypatch):
    """The engine then runs the update graph, and status() says why; ODT_UPDATE_KERNEL=0 asks for the graph."""
    assert update_kernel.status().startswith("native update kernel")
    missing = tmp_path / "linux-riscv64" / "libodt_update.so"
    assert update_kernel.load(missing) is None and "no update kernel is built for linux-riscv64" in \
        update_kernel.status(missing)  # fmt: skip
    garbage = tmp_path / "garbage.so"
    garbage.write_bytes(b"\x7fELF not really")
    assert update_kernel.load(garbage) is None and "does not load" in update_kernel.status(garbage)
    # a real library whose bits differ from the reference: its self-check fails
    copy = tmp_path / "copy" / "libodt_update.so"
    copy.parent.mkdir()
    shutil.copyfile(update_kernel.LIBRARY, copy)
    reference = update_kernel.adamw
    monkeypatch.setattr(update_kernel, "adamw", lambda w, *a, **k: (reference(w, *a, **k), w.__iadd__(1e-3)))
    assert update_kernel.load(copy) is None and "computes other bits" in update_kernel.status(copy)
    monkeypatch.setenv(update_kernel.ENV, "0")
    assert update_kernel.load() is None and update_kernel.status() == "the update graph (ODT_UPDATE_KERNEL=0)"
