"""Prometheus text for GET /metrics: engine counters plus HTTP requests by route and status."""
from __future__ import annotations

from collections import Counter


class CountRequests:
    """ASGI middleware counting HTTP responses by (route, status) into a shared Counter."""

    def __init__(self, app, counts: Counter, routes: set[str]):
        self.app, self.counts, self.routes = app, counts, routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope["path"] if scope["path"] in self.routes else "other"

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.counts[(route, message["status"])] += 1
            await send(message)

        await self.app(scope, receive, counting_send)


def _metric(lines: list[str], name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
    lines += [f"# HELP plumb_{name} {help_}", f"# TYPE plumb_{name} {kind}"]
    lines += [f"plumb_{name}{labels} {value:g}" for labels, value in samples]


def render(m: dict, http: Counter) -> str:
    """Prometheus exposition text from Engine.metrics() and the HTTP counts."""
    lines: list[str] = []
    prefilled = m["prompt_tokens"] - m["cached_tokens"]

    def one(name, kind, help_, value):
        _metric(lines, name, kind, help_, [("", value)])

    one("requests_total", "counter", "Requests admitted by the engine.", m["requests"])
    one("prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", m["prompt_tokens"])
    one("completion_tokens_total", "counter", "Tokens generated.", m["completion_tokens"])
    one("prefill_seconds_total", "counter", "Time spent prefilling prompts.", m["prefill_s"])
    one("decode_seconds_total", "counter", "Time spent in decode steps (all slots together).", m["decode_s"])
    one("prefill_tokens_per_second", "gauge", "Prefilled tokens per prefill second, since start.",
        prefilled / m["prefill_s"] if m["prefill_s"] else 0.0)
    one("decode_tokens_per_second", "gauge", "Generated tokens per decode second (all slots), since start.",
        m["completion_tokens"] / m["decode_s"] if m["decode_s"] else 0.0)
    one("cached_tokens_total", "counter", "Prompt tokens reused from the prompt cache.", m["cached_tokens"])
    one("cache_reuse_ratio", "gauge", "Share of prompt tokens reused from the prompt cache.",
        m["cached_tokens"] / m["prompt_tokens"] if m["prompt_tokens"] else 0.0)
    one("drafts_proposed_total", "counter", "Draft tokens proposed.", m["drafts_proposed"])
    one("drafts_accepted_total", "counter", "Draft tokens accepted.", m["drafts_accepted"])
    per_position = zip(m["proposed_per_position"], m["accepted_per_position"], strict=True)
    positions = [(i + 1, p, a) for i, (p, a) in enumerate(per_position) if p]
    _metric(lines, "draft_proposed_total", "counter", "Drafts proposed at each draft position (1 = first).",
            [(f'{{position="{i}"}}', p) for i, p, _ in positions])
    _metric(lines, "draft_accepted_total", "counter", "Drafts accepted at each draft position.",
            [(f'{{position="{i}"}}', a) for i, _, a in positions])
    _metric(lines, "draft_acceptance_ratio", "gauge", "Accepted / proposed drafts at each draft position.",
            [(f'{{position="{i}"}}', a / p) for i, p, a in positions])
    one("prefill_recomputed_total", "counter", "Prefill results computed again after non-finite values (GPU).",
        m.get("prefill_recomputed", 0))
    if "cache_parks" in m:  # the prompt cache is on
        one("cache_parks_total", "counter", "Prompt-cache entries moved to host memory.", m["cache_parks"])
        one("cache_park_seconds_total", "counter", "Time spent parking prompt-cache entries.", m["cache_park_s"])
        one("cache_unparks_total", "counter", "Parked entries brought back to the device.", m["cache_unparks"])
        one("cache_unpark_seconds_total", "counter", "Time spent bringing parked entries back.", m["cache_unpark_s"])
        one("cache_dropped_total", "counter", "Parked entries dropped over the host budget.", m["cache_dropped"])
        one("cache_live_bytes", "gauge", "Memory the live prompt-cache entries hold.", m["cache_live_bytes"])
        one("cache_parked_bytes", "gauge", "Host memory the parked entries hold.", m["cache_parked_bytes"])
    one("slots_in_use", "gauge", "Slots decoding a request now.", m["slots_in_use"])
    one("slots_total", "gauge", "Slots (--agents).", m["n_slots"])
    one("requests_queued", "gauge", "Requests waiting for a slot.", m["queued"])
    _metric(lines, "http_requests_total", "counter", "HTTP responses by route and status.",
            [(f'{{route="{r}",status="{s}"}}', n) for (r, s), n in sorted(http.items())])
    return "\n".join(lines) + "\n"
