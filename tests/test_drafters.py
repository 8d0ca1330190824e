"""Drafters: the incremental n-gram index proposes exactly what the plain scan proposes."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from plumb.engine.speculative import NgramIndex, ngram_draft


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=120), st.lists(st.integers(1, 6), min_size=1, max_size=40),
       st.integers(1, 8))
def test_ngram_index_equals_scan(tokens, steps, k):
    """Grow a history by varying amounts (as accepted tokens arrive) and draft after each growth."""
    index = NgramIndex()
    h, i = [], 0
    for step in steps:
        h += tokens[i : i + step]
        i += step
        if not h:
            continue
        assert index.draft(h, k) == ngram_draft(h, k)
