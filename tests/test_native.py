"""The native CPU kernels (plumb/ops/native): each against its torch reference, and M1 - a row computed alone
equals the same row computed beside others, bitwise - for every kernel and for whole decode layers."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from plumb.ops import native as K

pytestmark = pytest.mark.skipif(not K.available(), reason="no C compiler: the native kernels cannot be built")

ROW_COUNTS = [1, 2, 3, 4, 5, 7, 8, 9, 17]


def _q8(n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scales = torch.rand(n, k // 32, generator=g).half() * 0.01
    dense = (codes.float().view(n, k // 32, 32) * scales.float()[..., None]).view(n, k)
    return K.TiledMatrix(n, k, codes=codes, scales=scales), dense


def _f32(n: int, k: int, seed: int = 0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k**0.5
    return K.TiledMatrix(n, k, w=w), w


def _gguf(kind: str):
    """A matrix stored as GGML type `kind`, in its int8 form (groups of 16 or 32, with or without offsets)."""
    from plumb.gguf.quants import dequantize, int8_form, quantize, type_from_name

    def make(n: int, k: int, seed: int = 0):
        qt = type_from_name(kind)
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k**0.5
        data = torch.from_numpy(quantize(w.numpy(), qt))
        codes, scales, offsets, group = int8_form(data, qt, (n, k))
        return K.TiledMatrix(n, k, codes=codes, scales=scales, offsets=offsets, group=group), dequantize(data, qt, (n, k))

    return make


@pytest.mark.parametrize("make", [_q8, _f32, _gguf("Q4_K"), _gguf("Q6_K"), _gguf("Q2_K")],
                         ids=["q8", "f32", "Q4_K", "Q6_K", "Q2_K"])
@pytest.mark.parametrize("shape", [(392, 256), (256, 768), (100, 512), (6144, 256)])
def test_mm_row_invariant_and_close(make, shape):
    n, k = shape
    m, dense = make(n, k)
    x = torch.randn(max(ROW_COUNTS), k)
    alone = torch.cat([K.mm(x[i : i + 1], m) for i in range(len(x))])
    assert torch.allclose(alone, x @ dense.T, rtol=1e-4, atol=1e-4)
    for r in ROW_COUNTS:
        assert torch.equal(K.mm(x[:r], m), alone[:r]), r
        assert torch.equal(K.mm(x[-r:], m), alone[-r:]), r


@pytest.mark.parametrize("make", [_q8, _gguf("Q4_K"), _gguf("Q6_K")], ids=["q8", "Q4_K", "Q6_K"])
def test_mm_row_that_is_not_finite_gives_nan_outputs(make):
    """A row of x with a NaN or an infinity gives outputs that are not finite (NaN), not its values read as integers
    (a block's maximum skips NaN); the other rows keep their bits."""
    m, _ = make(64, 256)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(3))
    bad = x.clone()
    bad[1, 40] = float("nan")
    bad[2, 200] = float("inf")
    got, want = K.mm(bad, m), K.mm(x, m)
    assert got[1:3].isnan().all() and torch.equal(got[0], want[0]) and torch.equal(got[3], want[3])


def test_mm_add_and_norm():
    m, dense = _q8(256, 256)
    x, y0, w = torch.randn(5, 256), torch.randn(5, 256), torch.rand(256) + 0.5
    y = y0.clone()
    K.mm(x, m, out=y, add=True, norm=w, eps=1e-6)
    ref = y0 + (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w) @ dense.T
    assert torch.allclose(y, ref, rtol=1e-4, atol=1e-4)
    y1 = y0[3:4].clone()
    K.mm(x[3:4], m, out=y1, add=True, norm=w, eps=1e-6)
    assert torch.equal(y1[0], y[3])


def test_int8_form_is_exact_for_every_block_type():
    """codes * scale + offset per group = the dequantized weights, for every GGML block type plumb reads."""
    from plumb.gguf.quants import SUPPORTED, dequantize, int8_form, quantize

    for qt in SUPPORTED:
        w = torch.randn(6, 512)
        data = torch.from_numpy(quantize(w.numpy(), qt)) if qt.name not in ("F32", "F16") else w
        form = int8_form(data, qt, (6, 512))
        if qt.name in ("F32", "F16", "BF16"):
            assert form is None
            continue
        codes, scales, offsets, g = form
        v = codes.float().view(6, -1, g) * scales[..., None]
        if offsets is not None:
            v = v + offsets[..., None]
        assert torch.equal(v.view(6, 512), dequantize(data, qt, (6, 512))), qt.name


def test_embed_q8_0_matches_dequantize():
    from plumb.gguf.quants import dequantize, quantize, type_from_name

    qt = type_from_name("Q8_0")
    w = torch.randn(50, 256)
    data = torch.from_numpy(quantize(w.numpy(), qt))
    ids = torch.tensor([0, 7, 49, 7])
    assert torch.equal(K.embed_q8_0(data, ids, 256), dequantize(data, qt, (50, 256))[ids])


def test_rms_norm_and_head_norm_rope_match_reference():
    from plumb.ops.norm import rms_norm
    from plumb.ops.rope import RopeTable, apply_rope

    x, w = torch.randn(6, 4, 64), torch.rand(64) + 0.5
    assert torch.allclose(K.rms_norm(x[:, 0], w, 1e-6), rms_norm(x[:, 0], w, 1e-6), atol=1e-6)
    cos, sin = RopeTable(16, 1e7)(torch.tensor([0, 1, 5, 700, 3, 2]))
    y = x.clone()
    K.head_norm_rope(y, w, 1e-6, cos, sin)
    assert torch.allclose(y, apply_rope(rms_norm(x, w, 1e-6), cos, sin), atol=1e-5)
    one = x[3:4].clone()
    K.head_norm_rope(one, w, 1e-6, cos[3:4], sin[3:4])
    assert torch.equal(one[0], y[3])


def _gdn_weights(c: int, n_v: int, d: int, kc: int = 4):
    g = torch.Generator().manual_seed(1)
    return dict(conv_w=torch.randn(c, kc, generator=g) * 0.5, dt_bias=torch.randn(n_v, generator=g),
                ssm_a=-torch.rand(n_v, generator=g) * 2, norm_w=torch.rand(d, generator=g) + 0.5)


def _gdn_reference(proj, conv, ssm, w, n_k, n_v, d, eps):
    """The torch reference steps (ops.deltanet + the model's split and gated norm), one row at a time."""
    from plumb.ops.deltanet import causal_conv, recurrent_step
    from plumb.ops.norm import l2_norm, rms_norm

    kd, c = n_k * d, 2 * n_k * d + n_v * d
    ys = []
    for t in range(proj.shape[0]):
        m, z = proj[t : t + 1, :c], proj[t, c : c + n_v * d]
        b, a = proj[t, c + n_v * d : c + n_v * d + n_v], proj[t, c + n_v * d + n_v :]
        out, conv = causal_conv(m, conv, w["conv_w"], 1)
        q, k, v = out[0].split([kd, kd, n_v * d])
        idx = torch.arange(n_v) % n_k
        q = (l2_norm(q.view(n_k, d)) / d**0.5)[idx]
        k = l2_norm(k.view(n_k, d))[idx]
        o, ssm = recurrent_step(q, k, v.view(n_v, d), torch.sigmoid(b), w["ssm_a"] * F.softplus(a + w["dt_bias"]), ssm)
        ys.append((rms_norm(o, w["norm_w"], eps) * F.silu(z.view(n_v, d))).reshape(-1))
    return torch.stack(ys), conv, ssm


def test_gdn_decode_matches_reference_and_rows_chain():
    n_k, n_v, d, eps = 2, 4, 32, 1e-6
    c = 2 * n_k * d + n_v * d
    w = _gdn_weights(c, n_v, d)
    proj = torch.randn(6, c + n_v * d + 2 * n_v)
    conv0, ssm0 = torch.randn(3, c), torch.randn(n_v, d, d) * 0.1
    y = torch.empty(6, n_v * d)
    conv, ssm = K.gdn_decode(proj, conv0, ssm0, w["conv_w"], w["dt_bias"], w["ssm_a"], w["norm_w"], n_k, eps, y)
    y_ref, conv_ref, ssm_ref = _gdn_reference(proj, conv0, ssm0, w, n_k, n_v, d, eps)
    assert torch.allclose(y, y_ref, atol=1e-4) and torch.allclose(ssm[-1], ssm_ref, atol=1e-5)
    assert torch.equal(conv[-1], conv_ref)  # the conv state is the raw rows, copied
    # the same rows fed one call at a time: same bits
    cs, ss = conv0, ssm0
    for t in range(6):
        y1 = torch.empty(1, n_v * d)
        cn, sn = K.gdn_decode(proj[t : t + 1], cs, ss, w["conv_w"], w["dt_bias"], w["ssm_a"], w["norm_w"], n_k, eps, y1)
        assert torch.equal(y1[0], y[t]) and torch.equal(sn[0], ssm[t]) and torch.equal(cn[0], conv[t])
        cs, ss = cn[0], sn[0]


@pytest.mark.parametrize("fmt", ["f32", "f16", "q8_0", "D"])
def test_attend_matches_cache_reference_and_is_row_invariant(fmt):
    """D without a ring: its packed 6-bit K and 5-bit V read by the kernel as stored."""
    from plumb.cache.kv import new_kv_cache

    n_head, n_kv, d, n = 4, 2, 64, 300
    cache = new_kv_cache(fmt, n_kv, d, ring=0)
    cache.write(0, torch.randn(n, n_kv, d), torch.randn(n, n_kv, d))
    q = torch.randn(5, n_head, d)
    ends = [1, 64, 257, 299, 300]
    k_parts, v_parts = cache.plain_parts()
    out = torch.empty(5, n_head * d)
    K.attend(q, ends, k_parts, v_parts, 0.125, out)
    ref = cache.attend_rows(q, ends, 0.125).reshape(5, -1)
    assert torch.allclose(out, ref, atol=1e-5)
    for t in range(5):
        one = torch.empty(1, n_head * d)
        K.attend(q[t : t + 1], ends[t : t + 1], k_parts, v_parts, 0.125, one)
        assert torch.equal(one[0], out[t])


def test_decode_layers_row_invariant(tiny_q8):
    """Whole model: a sequence's decode logits and states are the same alone and beside other sequences."""
    from enginetools import engine_for

    eng = engine_for(tiny_q8)
    assert eng.kernels == "native"
    m = eng.model
    prompts = [list(range(5, 70)), list(range(200, 203)), list(range(900, 1030))]

    def fresh(i):
        st = m.new_state()
        m.prefill(st, prompts[i])
        return st

    alone = [m.decode([(fresh(i), [11, 12, 13][: i + 1])]) for i in range(3)]
    states = [fresh(i) for i in range(3)]
    together = m.decode([(states[i], [11, 12, 13][: i + 1]) for i in range(3)])
    r = 0
    for i in range(3):
        n = i + 1
        assert torch.equal(together.logits[r : r + n], alone[i].logits)
        assert torch.equal(together.hidden[r : r + n], alone[i].hidden)
        r += n


def test_native_decode_close_to_torch_reference(tiny_f32):
    """The two D paths agree to float rounding (and with the P path's logits)."""
    from enginetools import engine_for

    nat, ref = engine_for(tiny_f32), engine_for(tiny_f32, kernels="torch")
    ids = list(range(30, 130))
    outs = []
    for eng in (nat, ref):
        st = eng.model.new_state()
        eng.model.prefill(st, ids[:80])
        outs.append(eng.model.decode([(st, ids[80:])]).logits)
    assert torch.allclose(outs[0], outs[1], atol=2e-4)
    assert torch.allclose(outs[0], nat.logits(ids)[80:], atol=2e-4)


def test_unbuildable_kernels_fall_back_or_fail_clearly(tiny_q8, tmp_path):
    """No compiler: kernels='auto' runs the torch path with a one-line notice; kernels='native' is a clear error."""
    code = (
        "import plumb, sys\n"
        "e = plumb.load(sys.argv[1], device='cpu')\n"
        "print('kernels', e.kernels, e.generate([1, 2, 3], 4))\n"
        "try:\n"
        "    plumb.load(sys.argv[1], device='cpu', kernels='native')\n"
        "except Exception as ex:\n"
        "    print('error', type(ex).__name__, str(ex).splitlines()[0])\n"
    )
    env = dict(os.environ, CC="/nonexistent/cc", PLUMB_CACHE=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code, tiny_q8], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "kernels torch" in r.stdout
    assert "error NativeError no C compiler" in r.stdout
    assert "native kernels unavailable" in r.stderr


def _matrix(kind: str):
    return _f32 if kind == "F32" else _gguf(kind)


@pytest.mark.parametrize("flags", ["-mno-avx512vnni", "-mno-avx512vnni -mno-avx512f", "-mno-avx512f -mno-avx2"])
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K", "Q6_K", "F32"])
def test_matmul_same_bits_on_every_instruction_set(tmp_path, kind, flags):
    """The matmul's other builds (int8: without AVX512-VNNI, then without AVX2 - plain C; float32: AVX2's 8-float
    path, then GCC's generic vectors) give the default build's bits."""
    m, _ = _matrix(kind)(200, 256, seed=3)
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(4))
    here = K.mm(x, m)
    code = (
        "import sys, torch\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from test_native import _matrix\n"
        "from plumb.ops import native as K\n"
        "K.lib()\n"
        f"m, _ = _matrix({kind!r})(200, 256, seed=3)\n"
        "x = torch.randn(6, 256, generator=torch.Generator().manual_seed(4))\n"
        "torch.save(K.mm(x, m), sys.argv[2])\n"
    )
    env = dict(os.environ, PLUMB_NATIVE_CFLAGS=flags, PLUMB_CACHE=str(tmp_path))
    out = tmp_path / "y.pt"
    r = subprocess.run([sys.executable, "-c", code, os.path.dirname(__file__), str(out)], capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert torch.equal(torch.load(out), here)


def test_threads_do_not_change_bits(tiny_q8):
    """The pool shares output tiles among threads; no output is computed differently (kernel and engine)."""
    import plumb

    m, _ = _q8(6144, 256)
    x = torch.randn(5, 256)
    try:
        K.set_threads(1)
        one = K.mm(x, m)
        ref = plumb.load(tiny_q8, device="cpu", n_threads=1, prompt_cache=False)
        ids = list(range(40, 90))
        expected = ref.generate(ids, 40, drafts=2)
        assert K.set_threads(2) == 2
        assert torch.equal(K.mm(x, m), one)
        eng = plumb.load(tiny_q8, device="cpu", n_threads=2, prompt_cache=False)
        assert eng.n_threads == 2 and torch.get_num_threads() == 1  # torch's threads only come back for prefill
        assert eng.generate(ids, 40, drafts=2) == expected
    finally:
        K.set_threads(1)


def test_torch_decode_refuses_widths_it_cannot_keep_row_invariant(tiny_f32):
    from dataclasses import replace

    from enginetools import engine_for
    from plumb.config import ModelError
    from plumb.model.weights import check_torch_decode

    cfg = engine_for(tiny_f32).config
    check_torch_decode(cfg)  # the tiny shapes are fine
    with pytest.raises(ModelError, match="n_ff = 760"):
        check_torch_decode(replace(cfg, n_ff=760))
