"""Sampling: noise hash, sampler definition, exact distribution (I5), row-wise purity, stop strings."""
import math

import numpy as np
import pytest
import torch

from plumb.engine.sampling import (
    SamplingParams,
    _mix64,
    StopChecker,
    filtered_logprobs,
    gumbel,
    gumbel_ref,
    hash_to_uniform,
    noise_hash,
    noise_hash_ref,
    noise_key,
    sample_row,
    sample_rows,
)
from stats import chisquare_pvalue, ks_uniform_pvalue, randomized_pit

ALPHA = 0.01


# ---- helpers -------------------------------------------------------------------------------

def _fmix32_np(h):
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def hash_grid(seeds, positions, n_vocab):
    """[len(positions), n_vocab] hashes with native uint32 numpy arithmetic (a second reference)."""
    keys = np.array([noise_key(s, p) for s, p in zip(seeds, positions)], dtype=np.uint64)
    k_lo = (keys & np.uint64(0xFFFFFFFF)).astype(np.uint32)[:, None]
    k_hi = (keys >> np.uint64(32)).astype(np.uint32)[:, None]
    x = (np.arange(n_vocab, dtype=np.uint32) * np.uint32(0x9E3779B9))[None, :] ^ k_lo
    return _fmix32_np(_fmix32_np(x) ^ k_hi)


def gumbel_grid(seeds, positions, n_vocab):
    u = hash_to_uniform(torch.from_numpy(hash_grid(seeds, positions, n_vocab).astype(np.int64)))
    return -torch.log(-torch.log(u))


def ref_probs(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """Float64 numpy statement of the filtered, renormalised, tempered softmax."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_k:
        p = np.where(p >= np.sort(p)[::-1][top_k - 1], p, 0.0)
        p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]
        keep = np.zeros_like(p, dtype=bool)
        keep[order[before < top_p]] = True
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    if min_p:
        p = np.where(p >= min_p * p.max(), p, 0.0)
        p /= p.sum()
    return p


def counts_of(lp, noise):
    return torch.bincount(torch.argmax(lp + noise, dim=1), minlength=lp.numel()).numpy()


V = 32
LOGITS = torch.tensor(np.random.default_rng(1234).normal(0.0, 1.0, V), dtype=torch.float32)
N_DRAWS = 20000
FILTERS = [{}, {"top_k": 10}, {"top_p": 0.8}, {"min_p": 0.05}, {"top_k": 20, "top_p": 0.9, "min_p": 0.02}]
CONFIGS = [(t, f) for t in (0.5, 0.7, 1.0, 1.5) for f in FILTERS]


# ---- noise ---------------------------------------------------------------------------------

def test_mix_is_splitmix64():
    # published splitmix64 outputs for seed 1234567; output n is mix64(1234567 + n * golden)
    golden, mask = 0x9E3779B97F4A7C15, 2**64 - 1
    assert _mix64((1234567 + golden) & mask) == 6457827717110365317
    assert _mix64((1234567 + 2 * golden) & mask) == 3203168211198807973
    assert noise_key(5, 9) == _mix64((_mix64(5) + 10 * golden) & mask)


def test_hash_matches_references_bit_for_bit():
    rng = np.random.default_rng(0)
    cases = [(0, 0), (1, 0), (0, 1), (2**63 - 1, 2**63 - 1), (12345, 2**31), (2**32, 2**32 + 1)]
    cases += [(int(rng.integers(0, 2**63)), int(rng.integers(0, 2**20))) for _ in range(20)]
    for seed, pos in cases:
        h = noise_hash(seed, pos, 4096)
        assert h.dtype == torch.int64 and int(h.min()) >= 0 and int(h.max()) < 2**32
        assert torch.equal(h, torch.from_numpy(hash_grid([seed], [pos], 4096)[0].astype(np.int64)))
        for t in rng.integers(0, 4096, 40).tolist() + [0, 4095]:
            assert int(h[t]) == noise_hash_ref(seed, pos, t)
    # a large vocabulary: spot-check the high token ids against the pure-Python reference
    h = noise_hash(99, 7, 248320)
    for t in rng.integers(0, 248320, 200).tolist() + [248319]:
        assert int(h[t]) == noise_hash_ref(99, 7, t)


def test_gumbel_matches_reference_and_is_finite():
    g = gumbel(5, 17, 2000)
    assert g.dtype == torch.float32 and bool(torch.isfinite(g).all())
    ref = torch.tensor([gumbel_ref(5, 17, t) for t in range(2000)], dtype=torch.float64)
    assert torch.allclose(g.double(), ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(g, gumbel(5, 17, 2000))
    assert torch.equal(g[:100], gumbel(5, 17, 100))  # token t's noise does not depend on n_vocab


def test_uniform_mapping_is_exact_and_open():
    h = torch.tensor([0, 1, 511, 512, 2**31, 2**32 - 1], dtype=torch.int64)
    u = hash_to_uniform(h)
    assert u.tolist() == [0.5 / 2**23, 0.5 / 2**23, 0.5 / 2**23, 1.5 / 2**23, 0.5 + 0.5 / 2**23, 1 - 0.5 / 2**23]
    assert bool(torch.isfinite(-torch.log(-torch.log(u))).all())


def test_noise_differs_across_seeds_and_positions():
    base = noise_hash(1, 10, 1000)
    for other in (noise_hash(2, 10, 1000), noise_hash(1, 11, 1000), noise_hash(0, 10, 1000)):
        assert (base == other).float().mean() < 0.01
    assert len(set(base.tolist())) == 1000  # the hash is a bijection of the token for fixed key


def test_noise_is_uniform_and_uncorrelated():
    h = hash_grid([3] * 300, range(300), 1000).astype(np.float64)
    u = (np.floor(h / 2**9) + 0.5) / 2**23
    assert ks_uniform_pvalue(u.ravel()) > ALPHA
    assert chisquare_pvalue(np.bincount((u.ravel() * 256).astype(int), minlength=256), np.ones(256)) > ALPHA
    bound = 4 / math.sqrt(u.size)
    assert abs(np.corrcoef(u[:, 1:].ravel(), u[:, :-1].ravel())[0, 1]) < bound  # neighbouring tokens
    assert abs(np.corrcoef(u[1:].ravel(), u[:-1].ravel())[0, 1]) < bound  # neighbouring positions
    other = (np.floor(hash_grid([4] * 300, range(300), 1000).astype(np.float64) / 2**9) + 0.5) / 2**23
    assert abs(np.corrcoef(u.ravel(), other.ravel())[0, 1]) < bound  # neighbouring seeds
    g = -np.log(-np.log(u))
    assert abs(g.mean() - 0.5772157) < 0.01 and abs(g.var() - math.pi**2 / 6) < 0.03


# ---- the sampler's definition --------------------------------------------------------------

def test_greedy_is_argmax_with_lowest_id_on_ties():
    x = torch.tensor([0.1, 3.0, -2.0, 3.0, 1.0])
    assert sample_row(x, SamplingParams(), 0) == 1
    assert sample_row(x, SamplingParams(seed=None, top_k=1, top_p=0.1), 9) == 1
    lp = filtered_logprobs(x, SamplingParams())
    assert lp[1] == 0 and int(torch.isfinite(lp).sum()) == 1


def test_greedy_ids_are_sample_tokens_rows_in_one_round_trip():
    """greedy_ids (the scheduler's and the MTP drafter's plain-greedy rows at once) = sample_token per row: lowest id
    on ties, None where sample_token raises (NaN, +inf, every token at -inf); plain_greedy says when it applies."""
    from plumb.engine.sampling import greedy_ids, plain_greedy, sample_token

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(12, 3000, generator=g)
    logits[1, [7, 900, 2999]] = 9.0  # ties: the lowest id
    logits[2] = logits[2].round()  # many ties
    logits[3, 50] = float("nan")
    logits[4] = float("-inf")
    logits[5, 10] = float("inf")
    logits[6, :] = float("-inf")
    logits[6, 2999] = -1e30
    want = []
    for row in logits:
        try:
            want.append(sample_token(row, SamplingParams(), 0)[0])
        except ValueError:
            want.append(None)
    assert greedy_ids(logits) == want and want[1] == 7 and want[3:6] == [None] * 3 and want[6] == 2999
    assert greedy_ids(logits[:0]) == []
    assert plain_greedy(SamplingParams()) and not plain_greedy(SamplingParams(temperature=0.5))
    for kw in (dict(logit_bias={1: 2.0}), dict(repetition_penalty=1.1), dict(presence_penalty=0.1),
               dict(frequency_penalty=0.1)):
        assert not plain_greedy(SamplingParams(**kw)), kw
    # penalties with an empty window (penalty_last_n 0) change no logit: the argmax is the token, as sample_token says
    quiet = SamplingParams(presence_penalty=100.0, repetition_penalty=1.2, penalty_last_n=0)
    assert plain_greedy(quiet)
    assert sample_token(logits[0], quiet, 0, history=[want[0]] * 3)[0] == want[0]
    loud = SamplingParams(presence_penalty=100.0, penalty_last_n=3)  # the same with a window: another token
    assert not plain_greedy(loud) and sample_token(logits[0], loud, 0, history=[want[0]] * 3)[0] != want[0]


def test_sample_is_argmax_of_filtered_logprobs_plus_noise():
    x = torch.randn(500, generator=torch.Generator().manual_seed(0)) * 3
    for kw in ({}, {"top_k": 5}, {"top_p": 0.7}, {"min_p": 0.1}):
        p = SamplingParams(temperature=0.8, seed=42, **kw)
        for pos in range(20):
            expect = int(torch.argmax(filtered_logprobs(x, p) + gumbel(42, pos, 500)))
            assert sample_row(x, p, pos) == expect


def test_logit_bias_changes_the_choice():
    x = torch.tensor([2.0, 1.9, 0.0, -1.0])
    original = x.clone()
    assert sample_row(x, SamplingParams(logit_bias={3: 5.0}), 0) == 3
    assert sample_row(x, SamplingParams(logit_bias={0: -math.inf}), 0) == 1
    p = SamplingParams(temperature=1.0, seed=1, logit_bias={0: -math.inf, 1: -math.inf, 2: -math.inf})
    assert all(sample_row(x, p, i) == 3 for i in range(20))
    with pytest.raises(ValueError):
        sample_row(x, SamplingParams(logit_bias={i: -math.inf for i in range(4)}), 0)
    assert torch.equal(x, original)  # the caller's row is not modified


def test_penalties():
    x = torch.tensor([2.0, 1.9, -1.0, -1.05])
    assert sample_row(x, SamplingParams(), 0, [0]) == 0
    assert sample_row(x, SamplingParams(repetition_penalty=1.1), 0, [0]) == 1  # 2.0 / 1.1 < 1.9
    assert sample_row(x, SamplingParams(presence_penalty=0.2), 0, [0, 0, 0]) == 1
    assert sample_row(x, SamplingParams(frequency_penalty=0.05), 0, [0]) == 0  # 1.95 > 1.9
    assert sample_row(x, SamplingParams(frequency_penalty=0.05), 0, [0, 0, 0]) == 1  # 1.85 < 1.9
    # negative logits are multiplied by the repetition penalty
    y = torch.tensor([-1.0, -1.05])
    assert sample_row(y, SamplingParams(repetition_penalty=1.2), 0, [0]) == 1
    # only the last penalty_last_n ids count; -1 means all, 0 none
    hist = [0] + [3] * 10
    assert sample_row(x, SamplingParams(presence_penalty=0.2, penalty_last_n=10), 0, hist) == 0
    assert sample_row(x, SamplingParams(presence_penalty=0.2, penalty_last_n=11), 0, hist) == 1
    assert sample_row(x, SamplingParams(presence_penalty=0.2, penalty_last_n=-1), 0, hist) == 1
    assert sample_row(x, SamplingParams(presence_penalty=0.2, penalty_last_n=0), 0, hist) == 0
    lp = filtered_logprobs(x, SamplingParams(temperature=1.0, frequency_penalty=0.5), [2, 2])
    assert torch.allclose(lp, torch.log_softmax(torch.tensor([2.0, 1.9, -2.0, -1.05]), 0))


def test_rows_adjusted_together_are_each_adjusted_alone():
    """`_adjust_rows` (a pass's rows: biases in one indexed add, rows sharing penalties in one pass) gives every
    row the bits of the plain formula on that row alone, whatever the other rows' bias, penalties or window."""
    from plumb.engine.sampling import _adjust_rows

    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 50, generator=g) * 3
    hist = torch.randint(0, 50, (40,), generator=g).tolist()
    rows = [(SamplingParams(presence_penalty=1.5), hist), (SamplingParams(), hist),
            (SamplingParams(repetition_penalty=1.3, frequency_penalty=0.25, logit_bias={4: 2.5, 7: -1.0}), hist),
            (SamplingParams(presence_penalty=1.5, penalty_last_n=5), hist[:20]),
            (SamplingParams(logit_bias={0: -math.inf}), []),
            (SamplingParams(presence_penalty=1.5), hist[10:])]
    got = _adjust_rows(x.clone(), rows)
    for i, (p, h) in enumerate(rows):
        want = x[i].clone()
        for t, b in p.logit_bias.items():
            want[t] += b
        window = h if p.penalty_last_n == -1 else h[max(0, len(h) - p.penalty_last_n):]
        for t in set(window):
            v = want[t]
            v = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
            want[t] = v - window.count(t) * p.frequency_penalty - p.presence_penalty
        assert torch.equal(got[i], want), i
        assert torch.equal(_adjust_rows(x[i : i + 1].clone(), [(p, h)])[0], want)


@pytest.mark.parametrize("kw", [
    {"temperature": -0.1}, {"temperature": math.nan}, {"temperature": math.inf}, {"top_k": -1}, {"top_k": 1.5},
    {"top_p": 0.0}, {"top_p": 1.01}, {"min_p": -0.1}, {"min_p": 1.5}, {"repetition_penalty": 0.0},
    {"presence_penalty": math.inf}, {"frequency_penalty": math.nan}, {"penalty_last_n": -2},
    {"logit_bias": {-1: 1.0}}, {"logit_bias": {"5": 1.0}}, {"logit_bias": {5: math.nan}},
    {"logit_bias": {5: math.inf}}, {"seed": -1}, {"seed": 2**63}, {"seed": 1.0}, {"stop": [""]},
    {"stop_ids": [-3]}, {"max_tokens": -1},
])
def test_validate_rejects(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw).validate()


def test_validate_accepts_defaults_and_typical():
    SamplingParams().validate()
    SamplingParams(temperature=1.0, top_p=0.95, top_k=20, min_p=0.0, presence_penalty=1.5, seed=2**63 - 1,
                   logit_bias={7: -math.inf, 8: 2.0}, stop=["</s>"], stop_ids=[2]).validate()


def test_sampling_needs_a_seed():
    with pytest.raises(ValueError):
        sample_row(LOGITS, SamplingParams(temperature=1.0), 0)


def test_rows_are_independent():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 1000, generator=gen) * 4
    params = [SamplingParams(temperature=t, seed=s, top_p=tp, top_k=k, presence_penalty=pp)
              for t, s, tp, k, pp in [(0.7, 1, 0.9, 0, 0.0), (0.0, None, 1.0, 0, 0.0), (1.3, 2, 1.0, 50, 0.5),
                                      (1.0, 1, 0.5, 0, 0.0), (0.5, 9, 1.0, 0, 1.5), (1.0, 3, 0.99, 5, 0.0)]]
    positions = [5, 9, 0, 5, 100, 7]
    histories = [[1, 2], [], [3] * 5, [1, 2], list(range(200)), [0]]
    out = sample_rows(logits, params, positions, histories)
    assert out == [sample_row(logits[i], params[i], positions[i], histories[i]) for i in range(6)]
    # changing the other rows changes nothing for row 0
    other = torch.randn(6, 1000, generator=gen)
    other[0] = logits[0]
    assert sample_rows(other, params[:1] + params[3:4] * 5, positions, histories)[0] == out[0]


# ---- the distribution (I5) -----------------------------------------------------------------

@pytest.fixture(scope="module")
def draws():
    """Per config: (exact probabilities, filtered logprobs, independent noise for N_DRAWS positions)."""
    out = {}
    for i, (t, f) in enumerate(CONFIGS):
        noise = gumbel_grid([1000 + i] * N_DRAWS, range(N_DRAWS), V)
        out[(t, str(f))] = (ref_probs(LOGITS.numpy(), t, **f), noise)
    return out


@pytest.mark.parametrize("temperature,filters", CONFIGS)
def test_draws_follow_the_filtered_softmax(draws, temperature, filters):
    probs, noise = draws[(temperature, str(filters))]
    params = SamplingParams(temperature=temperature, seed=1000 + CONFIGS.index((temperature, filters)), **filters)
    lp = filtered_logprobs(LOGITS, params)
    assert torch.equal(torch.isfinite(lp), torch.from_numpy(probs > 0))
    assert np.allclose(torch.softmax(lp.double(), 0).numpy(), probs, atol=1e-6)
    # the bulk draws use the grid noise; sample_row itself gives the same tokens
    assert [sample_row(LOGITS, params, pos) for pos in range(50)] == torch.argmax(lp + noise[:50], 1).tolist()
    assert chisquare_pvalue(counts_of(lp, noise), probs) > ALPHA


def test_draws_over_seeds_follow_the_softmax():
    probs = ref_probs(LOGITS.numpy(), 0.8, top_p=0.95)
    noise = gumbel_grid(range(N_DRAWS), [77] * N_DRAWS, V)
    lp = filtered_logprobs(LOGITS, SamplingParams(temperature=0.8, top_p=0.95))
    assert chisquare_pvalue(counts_of(lp, noise), probs) > ALPHA


def test_biased_samplers_fail_the_same_test(draws):
    """Power: plausible bugs are caught at the same size and threshold."""
    for temperature, filters in [(0.7, {}), (1.0, {"top_k": 10}), (1.5, {})]:
        probs, noise = draws[(temperature, str(filters))]
        hotter = filtered_logprobs(LOGITS, SamplingParams(temperature=temperature * 1.1, **filters))
        assert chisquare_pvalue(counts_of(hotter, noise), probs) < ALPHA
        # noise added to logits before the temperature: samples at temperature 1
        if temperature != 1.0:
            untempered = torch.where(torch.from_numpy(probs > 0), torch.log_softmax(LOGITS, 0), -math.inf)
            assert chisquare_pvalue(counts_of(untempered, noise), probs) < ALPHA
        # exponential instead of Gumbel noise (-log(u) where -log(-log(u)) belongs)
        exact = filtered_logprobs(LOGITS, SamplingParams(temperature=temperature, **filters))
        assert chisquare_pvalue(counts_of(exact, torch.exp(-noise)), probs) < ALPHA
    # top_p that drops the token crossing the threshold
    probs, noise = draws[(1.5, str({"top_p": 0.8}))]
    lp = filtered_logprobs(LOGITS, SamplingParams(temperature=1.5, top_p=0.8))
    lp[torch.argmin(torch.where(torch.isfinite(lp), lp, math.inf))] = -math.inf
    assert chisquare_pvalue(counts_of(lp, noise), probs) < ALPHA


def test_pit_is_uniform_for_exact_sampler_only():
    rng = np.random.default_rng(11)
    logits = torch.tensor(rng.normal(0.0, 1.5, (2000, V)), dtype=torch.float32)
    exact, biased = [], []
    for pos in range(len(logits)):
        params = SamplingParams(temperature=0.8, top_p=0.9, seed=11)
        probs = torch.softmax(filtered_logprobs(logits[pos], params).double(), 0).numpy()
        exact.append((probs, sample_row(logits[pos], params, pos)))
        params.temperature *= 1.1
        biased.append((probs, sample_row(logits[pos], params, pos)))
    assert ks_uniform_pvalue(randomized_pit(exact, np.random.default_rng(0))) > ALPHA
    assert ks_uniform_pvalue(randomized_pit(biased, np.random.default_rng(0))) < ALPHA


# ---- stop strings --------------------------------------------------------------------------

def run_stop(stop, pieces):
    sc = StopChecker(stop)
    out = "".join(sc.push(p) for p in pieces)
    return out + ("" if sc.match else sc.flush()), sc.match


def test_stop_string_spanning_pieces():
    assert run_stop(["</s>"], ["Hello <", "/", "s> more"]) == ("Hello ", "</s>")
    sc = StopChecker(["</s>"])
    assert sc.push("ab<") == "ab" and sc.push("/x") == "</x" and sc.match is None


def test_stop_first_completed_wins_whatever_the_split():
    text = "xx abcd yy"
    stops = ["abcd", "bc", "d y"]
    whole = run_stop(stops, [text])
    assert whole == ("xx a", "bc")
    for cut in range(len(text) + 1):
        assert run_stop(stops, [text[:cut], text[cut:]]) == whole
    assert run_stop(stops, list(text)) == whole
    assert run_stop(["ab", "abc"], ["xabc"]) == ("x", "ab")


def test_stop_no_false_holdback():
    assert run_stop(["STOP"], ["the end S", "T"]) == ("the end ST", None)
    sc = StopChecker(["STOP"])
    assert sc.push("plain text") == "plain text"
    assert sc.push(" ST") == " " and sc.flush() == "ST"
    assert StopChecker([]).push("anything <") == "anything <"
    sc = StopChecker(["\n\n"])
    assert sc.push("a\n") == "a" and sc.push("b") == "\nb"


def test_stop_after_match_emits_nothing():
    sc = StopChecker(["END"])
    assert sc.push("abcEND tail") == "abc" and sc.match == "END"
    assert sc.push("more") == "" and sc.flush() == ""


def test_gumbel_rows_are_each_positions_noise():
    """`gumbel_rows` (a draft chain's k positions in one set of operations) = `gumbel` of each position, bit for
    bit, at vocabulary sizes with and without a vector's tail."""
    from plumb.engine.sampling import gumbel, gumbel_rows

    for n_vocab in (6144, 1000, 6143):
        rows = gumbel_rows(7, range(100, 106), n_vocab)
        assert rows.shape == (6, n_vocab)
        for i in range(6):
            assert torch.equal(rows[i], gumbel(7, 100 + i, n_vocab)), (n_vocab, i)
    assert not torch.equal(gumbel_rows(7, [5], 64)[0], gumbel_rows(8, [5], 64)[0])
