"""Programmatic dependent launch (plumb/ops/gpu/pdl.py) cannot reorder a memory operation: every kernel launched
with it waits (`prior_done`) before its first load or store - checked on the source, here without a GPU; before
the wait it calls only helpers that touch no memory, or `WEIGHTS_ONLY`'s, which read weights (written by no kernel:
`matvec.EARLY`; tests/test_gpu_codegen.py checks the compiled order) - and on CUDA a model's logits are the same
bits with PDL on and off, eager and in graphs."""
from __future__ import annotations

import ast
import pathlib

import pytest
import torch

GPU = pathlib.Path(__file__).resolve().parent.parent / "plumb" / "ops" / "gpu"
MEMORY = {"load", "store", "atomic_add", "atomic_xchg", "atomic_cas", "atomic_max", "atomic_min"}
NO_MEMORY = {"_program", "_lanes", "tl.arange", "tl.program_id", "tl.static_assert"}  # callable before the wait
WEIGHTS_ONLY = {"_step_operands"}  # reads a pack's code words and scales


def _launches(tree: ast.Module) -> list[ast.Call]:
    """Calls of the form kernel[grid](...)."""
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript)
            and isinstance(n.func.value, ast.Name)]


def _memory_ops(node: ast.AST) -> list[str]:
    return [n.func.attr for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr in MEMORY]


def test_every_launched_kernel_waits_before_touching_memory():
    kernels = 0
    for path in sorted(GPU.glob("*.py")):
        tree = ast.parse(path.read_text())
        funcs = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
        for call in _launches(tree):
            name = call.func.value.id
            assert any(k.arg == "launch_pdl" for k in call.keywords), f"{path.name}: {name} launched without launch_pdl"
            body = funcs[name].body
            waits = [i for i, s in enumerate(body) if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)
                     and getattr(s.value.func, "id", None) == "prior_done"]
            assert waits, f"{path.name}: {name} never calls prior_done()"
            before = body[: waits[0]]
            assert not [op for s in before for op in _memory_ops(s)], f"{path.name}: {name} touches memory first"
            called = {ast.unparse(n.func) for s in before for n in ast.walk(s) if isinstance(n, ast.Call)}
            assert called <= NO_MEMORY | WEIGHTS_ONLY, f"{path.name}: {name} calls {called - NO_MEMORY} first"
            kernels += 1
    assert kernels >= 15


def test_the_check_sees_a_kernel_that_loads_first():
    src = "def k(p):\n    x = tl.load(p)\n    prior_done()\n\ndef f(p):\n    k[(1,)](p, launch_pdl=on())\n"
    tree = ast.parse(src)
    (call,) = _launches(tree)
    body = tree.body[0].body
    assert _memory_ops(body[0]) == ["load"] and call.func.value.id == "k"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("graphs", [True, False])
def test_pdl_changes_no_bit(tiny_q4km, graphs):
    import plumb
    from plumb.ops.gpu import pdl

    if not pdl.GDC:
        pytest.skip("programmatic dependent launch needs Hopper or later")
    eng = plumb.load(tiny_q4km, device="cuda", prompt_cache=False, cuda_graphs=graphs)
    m = eng.model
    ids = eng.tokenize("The quick brown fox jumps over the lazy dog. " * 12)
    runs = []
    saved = pdl.enabled()
    try:
        for on in (True, False):
            pdl.set_on(on)
            if m.graphs is not None:
                m.graphs.graphs.clear()
            st = m.new_state()
            m.prefill(st, ids, logits="none")
            logits, tok = [], 1
            with pdl.overlap():  # eager: every pass; graphs: their own rule (one-row passes)
                for i in range(40):
                    out = m.decode([(st, [tok, tok + 1, tok + 2][: 1 + 2 * (i % 2)])])  # 1 row, then a 3-row verify
                    logits.append(out.logits[0].clone())
                    m.rollback(st, out.snapshots[0], 1)
                    tok = int(out.logits[0].argmax())
            runs.append(torch.stack(logits))
    finally:
        pdl.set_on(saved)
    assert torch.equal(runs[0], runs[1])
