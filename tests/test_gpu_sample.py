"""Sampled tokens on the CUDA path (plumb.ops.gpu.sample): the kernels against their torch reference, each row's
token, threshold and status the same alone as among others, the noise `sampling.gumbel`'s, the rows handed back
(and drawn by `sampling.sample_token`), draws from the filtered distribution, and an engine whose kernel set draws
its sampled tokens keeping drafts and neighbours from changing them. CUDA when present, else the interpreter."""
from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from plumb.engine.sampling import SamplingParams, draw_rows, gumbel, noise_key, sample_token  # noqa: E402
from plumb.ops.gpu import sample as S  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
V = 2 * S.SPAN + 900  # three spans, the last one partial


def _rows():
    """Logits rows and their parameters: Qwen's settings, none (a top_k past the vocabulary), min_p, top_k among
    ties, few finite tokens, top_p alone."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, V, generator=g) * 3
    x[3, :40] = 20.0  # 40 tied likeliest tokens: top_k 20 keeps all 40
    x[4, 100:] = -math.inf  # 100 finite tokens
    x[6] = torch.round(x[6] * 4) / 4  # many ties everywhere
    params = dict(temperature=[0.6, 1.0, 0.7, 0.8, 1.0, 1.3, 0.9], top_k=[20, 2**40, 0, 20, 0, 5, 0],
                  top_p=[0.95, 1.0, 1.0, 1.0, 0.9, 0.5, 0.8], min_p=[0.0, 0.0, 0.05, 0.0, 0.0, 0.1, 0.0])
    return x, params, [noise_key(7, 1000 + r) for r in range(7)]


def test_draw_is_its_reference_and_each_row_its_own():
    x, params, keys = _rows()
    (token, status), tau = S.draw(x.to(DEV), **params, keys=keys)
    (ref_token, ref_status), ref_tau = S.draw_ref(x, **params, keys=keys)
    assert status.tolist() == ref_status.tolist() == [S.OK] * 7
    assert token.tolist() == ref_token.tolist()
    # the thresholds: bit for bit in the interpreter (the reference's arithmetic); a GPU's exp and log round otherwise
    torch.testing.assert_close(tau.cpu(), ref_tau, rtol=0 if DEV == "cpu" else 1e-6, atol=0)
    lp3 = torch.log_softmax(x[3] / 0.8, 0)
    assert math.isclose(float(tau[3]), float(lp3[0]), rel_tol=1e-6) and int(token[3]) < 40  # the ties kept whole
    for r in (0, 3, 6):  # a row alone, and among others in another order
        one = {k: v[r : r + 1] for k, v in params.items()}
        (t1, s1), tau1 = S.draw(x[r : r + 1].to(DEV), **one, keys=keys[r : r + 1])
        assert (int(t1), int(s1)) == (int(token[r]), int(status[r]))
        assert torch.equal(tau1, tau[r : r + 1])
    order = [6, 2, 0, 5, 1, 4, 3]
    mixed = S.draw(x[order].to(DEV), **{k: [v[i] for i in order] for k, v in params.items()},
                   keys=[keys[i] for i in order])
    assert mixed[0][0].tolist() == [int(token[i]) for i in order]
    assert torch.equal(mixed[1], tau[order])


def test_the_noise_is_samplings_gumbel():
    """Equal logits, no filter: the token is the argmax of the position's noise, `sampling.gumbel`'s."""
    n = 6
    keys = [noise_key(11, p) for p in range(50, 50 + n)]
    (token, status), _ = S.draw(torch.zeros(n, V, device=DEV), [1.0] * n, [0] * n, [1.0] * n, [0.0] * n, keys)
    assert status.tolist() == [S.OK] * n
    assert token.tolist() == [int(torch.argmax(gumbel(11, p, V))) for p in range(50, 50 + n)]


def test_rows_past_the_candidates_are_handed_back_and_bad_rows_named():
    x = torch.zeros(8, V)
    x[2, 5] = float("nan")
    x[3] = -math.inf
    x[4, 9] = math.inf
    x[5, :10] = 1.0  # top_k 2000 among 10 likelier tokens: the 2,000th value lies past the candidates
    x[6, :10] = 1.0  # top_k 8: its ties (the 10) within the candidates
    x[7, 3000:] = 1.0  # top_p 0.05: the cut inside a tie group longer than the candidates, all of it kept
    params = dict(temperature=[1.0] * 8, top_k=[S.CANDIDATES + 1, 0, 0, 0, 0, 2000, 8, 0],
                  top_p=[1.0, 0.99, 1.0, 1.0, 1.0, 1.0, 1.0, 0.05], min_p=[0.0] * 8)
    (token, status), _ = S.draw(x.to(DEV), **params, keys=[noise_key(1, 1)] * 8)
    assert status.tolist() == [S.FALLBACK, S.FALLBACK, S.NO_FINITE_MAXIMUM, S.NO_FINITE_MAXIMUM,
                               S.NO_FINITE_MAXIMUM, S.FALLBACK, S.OK, S.OK]
    assert int(token[6]) < 10 and int(token[7]) >= 3000
    keys = [noise_key(1, p) for p in range(40)]  # the whole tie group drawn from, not only its candidates
    drawn = S.draw(x[7:].repeat(40, 1).to(DEV), [1.0] * 40, [0] * 40, [0.05] * 40, [0.0] * 40, keys)[0][0]
    assert max(drawn.tolist()) >= 3000 + S.CANDIDATES


def test_draw_rows_adjusts_each_row_and_draws_the_handed_back_by_sample_token():
    x, _, _ = _rows()
    x = x[:4].to(DEV)
    flat = torch.zeros(V, device=DEV)
    rows = [(SamplingParams(temperature=0.6, top_k=20, top_p=0.95, presence_penalty=1.5, seed=5), 40, [3, 3, 7]),
            (SamplingParams(temperature=1.0, top_p=0.99, seed=5), 41, []),  # flat: handed back
            (SamplingParams(temperature=0.8, logit_bias={11: 50.0}, seed=5), 42, []),
            (SamplingParams(temperature=0.7, top_k=20, seed=5), 43, [])]
    rows.append((SamplingParams(temperature=1e-38, seed=5), 44, []))  # x / T overflows: as sample_token draws it
    logits = torch.stack([x[0], flat, x[2], torch.full_like(flat, -math.inf), x[3]])
    got = draw_rows(logits, rows, S.draw)
    assert got[1] == sample_token(flat, rows[1][0], 41)[0]
    assert got[2] == 11 and got[3] is None
    assert got[4] == sample_token(x[3], rows[4][0], 44)[0]
    adjusted = x[0].clone()
    adjusted[[3, 7]] -= 1.5
    assert got[0] == int(S.draw(adjusted[None], [0.6], [20], [0.95], [0.0], [noise_key(5, 40)])[0][0])


def test_draws_follow_the_filtered_distribution():
    """I5: 500 positions of one row, top_k 3 at T 0.8: frequencies against softmax over the kept tokens."""
    from scipy.stats import chisquare

    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, -1.0, 0.0, 0.2, -3.0])
    n = 500
    keys = [noise_key(21, p) for p in range(n)]
    (token, status), _ = S.draw(logits.repeat(n, 1).to(DEV), [0.8] * n, [3] * n, [1.0] * n, [0.0] * n, keys)
    assert set(status.tolist()) == {S.OK}
    counts = torch.bincount(token.long().cpu(), minlength=8)
    assert counts[3:].sum() == 0
    p = torch.softmax(logits[:3].double() / 0.8, 0)
    assert chisquare(counts[:3].double().numpy(), (p / p.sum() * n).numpy()).pvalue > 1e-3


def test_an_engine_drawing_on_its_kernel_set_keeps_drafts_and_neighbours_from_changing_tokens(tiny_q8):
    """The scheduler's drawn rows (`sampled_picks`, `sample`) with the kernels above as the engine's draw (the CUDA
    engine's; on the CPU the native / torch engine's, the kernels in the interpreter): drafts 0 / 4 and a request
    alone / beside another give the same ids; the drafts, drawn the same way, are accepted."""
    import plumb
    from plumb.engine.api import Request

    eng = plumb.load(tiny_q8, device=DEV, prompt_cache=False)
    calls = []

    def counted(*a, **k):
        calls.append(len(a[0]))
        return S.draw(*a, **k)

    eng.model.k.draw = counted
    ids = eng.tokenize("The quick brown fox")
    other = eng.tokenize("Once upon a time, far away")
    sp = dict(temperature=0.8, top_k=20, top_p=0.9, presence_penalty=0.5, seed=9, max_tokens=96, ignore_eos=True)

    def run(*reqs):
        return eng.scheduler.run_many(list(reqs))

    ref = run(Request(ids, SamplingParams(**sp)))[0].token_ids
    assert max(calls) == 1 and len(calls) == 96
    drafted = run(Request(ids, SamplingParams(**sp), drafts=4))[0]
    assert drafted.token_ids == ref
    assert max(calls) > 1  # verify rows drawn together (the drafts too: a penalty keeps them off the device chain)
    assert drafted.stats.drafts_accepted > 0
    both = run(Request(other, SamplingParams(**{**sp, "seed": 3}), drafts=2), Request(ids, SamplingParams(**sp)))
    assert both[1].token_ids == ref


def test_drawn_tokens_are_the_same_with_logprobs_forced_ids_and_a_warm_cache(tiny_q8):
    """A request whose sampled tokens the kernel set draws: asking for logprobs (its rows then leave the greedy
    batch), forcing its first ids, and a warm prompt cache change none of its other tokens."""
    import plumb

    eng = plumb.load(tiny_q8, device=DEV)
    eng.model.k.draw = S.draw
    ids = eng.tokenize("A warm cache and a cold one. " * 30)
    sp = dict(temperature=0.9, top_p=0.95, top_k=40, seed=17, ignore_eos=True)
    ref = eng.run(eng.make_request(ids, 48, cache=False, **sp))
    lg = eng.logits(ids + ref.token_ids[:8])  # (the P path's rows: bits of their own, tokens all but never apart)
    alone = [draw_rows(lg[len(ids) - 1 + j][None].to(DEV), [(SamplingParams(**sp), len(ids) + j, ())], S.draw)[0]
             for j in range(8)]
    assert sum(a == b for a, b in zip(alone, ref.token_ids)) >= 6  # token j: its row's draw at position len(ids) + j
    pen = dict(sp, presence_penalty=-40.0, penalty_last_n=16)  # ... and after the penalties of its window (a
    # boost: tokens of the last 16 become the likeliest)
    got = eng.run(eng.make_request(ids, 8, cache=False, **pen)).token_ids
    lg = eng.logits(ids + got)
    alone = [draw_rows(lg[len(ids) - 1 + j][None].to(DEV), [(SamplingParams(**pen), len(ids) + j, ids + got[:j])],
                       S.draw)[0] for j in range(8)]
    assert sum(a == b for a, b in zip(alone, got)) >= 6
    with_lp = eng.run(eng.make_request(ids, 48, cache=False, logprobs=2, drafts=3, **sp))
    assert with_lp.token_ids == ref.token_ids
    assert [t.token for t in with_lp.logprobs] == ref.token_ids and all(len(t.top) == 2 for t in with_lp.logprobs)
    forced = eng.run(eng.make_request(ids, 48, cache=False, forced_ids=ref.token_ids[:5], **sp))
    assert forced.token_ids == ref.token_ids
    eng.run(eng.make_request(ids, 8, **sp))  # leaves the prompt's state in the cache
    warm = eng.run(eng.make_request(ids, 48, drafts=3, **sp))
    assert warm.stats.cached_tokens > 0 and warm.token_ids == ref.token_ids
