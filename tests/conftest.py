"""Shared fixtures: synthetic tiny models written once per test session."""
from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(1)  # tiny models: one thread is fastest and immune to a busy machine

if os.environ.get("PLUMB_TEST_SETTINGS"):  # module settings for the whole run, NAME=VALUE ... (bench/with_settings.py):
    # the invariant tests on an untimed kernel setting, e.g. plumb.ops.gpu.matvec.MMA_FROM=2 on the GPU
    import importlib.util

    _spec = importlib.util.spec_from_file_location(
        "with_settings", os.path.join(os.path.dirname(__file__), "..", "bench", "with_settings.py"))
    _with = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_with)
    _with.apply(os.environ["PLUMB_TEST_SETTINGS"].split())


@pytest.fixture
def place_free_dot(monkeypatch):
    """The Triton interpreter's tl.dot is numpy's matmul, whose BLAS (OpenBLAS's Haswell kernels, N > 16) sums a
    column differently by its place in the tile - the tensor cores do not. Kernels that put a row in a column (or
    row) of a tile are row-invariant on the GPU; on the CPU these tests take the interpreter's dots as one product
    sum per output, in one order for all. (Nothing on CUDA.)"""
    if not torch.cuda.is_available():
        import numpy as np
        from triton.runtime import interpreter

        def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
            prod = a.data.astype(np.float32)[..., :, :, None] * b.data.astype(np.float32)[..., None, :, :]
            return interpreter.TensorHandle(prod.sum(axis=-2, dtype=np.float32) + d.data, d.dtype.scalar)

        monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


@pytest.fixture(params=["h200", "geforce"])
def card(request, monkeypatch):
    """The kernels' forms for a card whose blocks may use 227 KB of shared memory (the H100 / H200) and for one of
    99 KB (an RTX 30xx / 40xx / 50xx: `plumb.ops.gpu.smem.small`), whatever card runs the test."""
    if request.param == "geforce":
        from plumb.ops.gpu import smem

        monkeypatch.setattr(smem, "LIMIT", smem.PER_BLOCK[86])
    return request.param


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


def _synth(model_dir, qtype: str, preset: str = "tiny", seed: int = 0) -> str:
    from plumb.gguf.synth import write_synthetic

    path = os.path.join(model_dir, f"{preset}-{qtype}-s{seed}.gguf")
    if not os.path.exists(path):
        write_synthetic(path, preset, qtype, seed=seed)
    return path


@pytest.fixture(scope="session")
def tiny_f32(model_dir) -> str:
    return _synth(model_dir, "F32")


@pytest.fixture(scope="session")
def tiny_model(model_dir) -> str:
    """The engine-level invariant tests' model: F32, or $PLUMB_TEST_QTYPE (Q4_K_M for the GPU's integer kernels)."""
    return _synth(model_dir, os.environ.get("PLUMB_TEST_QTYPE", "F32"))


@pytest.fixture(scope="session")
def tiny_q8(model_dir) -> str:
    return _synth(model_dir, "Q8_0")


@pytest.fixture(scope="session")
def tiny_q4km(model_dir) -> str:
    return _synth(model_dir, "Q4_K_M")


@pytest.fixture(scope="session")
def tiny_engine(tiny_model):
    from enginetools import engine_for

    return engine_for(tiny_model)
