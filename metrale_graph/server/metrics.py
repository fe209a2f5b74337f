"""The server's Prometheus metrics (GET /metrics), one registry per app.

Read from the engine at each scrape (Engine.stats()): running and waiting requests, slots and KV
blocks in use, engine steps, and with speculative decoding (Engine(speculative=...)) its acceptance counters:
draft tokens proposed and accepted, drafts verified (one per stream and verify step) and verify steps
(`metrale_spec_decode_num_draft_tokens`, `..._num_accepted_tokens`, `..._num_drafts` as vLLM's, and
`metrale_spec_decode_verify_steps`); a stream's mean acceptance length is 1 + accepted / drafts. Counted by
the server per request (`RequestMetrics`): time to first token, inter-token latency and end-to-end latency
histograms, and as each request ends its prompt
and new tokens, its finish reason ("stop", "length", "abort": the client went away; "error": it
failed), and the prefix cache's queried and hit prompt tokens (`cached_tokens` of a
GenerationResult, 0 while the engine has no prefix cache), whose ratio is the hit rate. Names follow vLLM's
(`vllm:time_to_first_token_seconds` here is `metrale_time_to_first_token_seconds`).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "metrale_"
# vLLM's buckets: first tokens from 1 ms to minutes (a long queue), token gaps from 10 ms to seconds
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error")
# speculative decoding's counters (vLLM's names but the last): (metric, help, key of Engine.stats().speculative)
SPECULATIVE = (
    ("spec_decode_num_draft_tokens", "Draft tokens proposed (verified by the main model).", "proposed"),
    ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", "accepted"),
    ("spec_decode_num_drafts", "Drafts verified: one per speculating stream and verify step.", "drafts"),
    ("spec_decode_verify_steps", "Engine steps that verified drafts.", "steps"),
)


class EngineCollector:
    """Gauges and counters read from Engine.stats() when Prometheus scrapes."""

    def __init__(self, engine, model_name: str):
        self.engine, self.labels = engine, {"model_name": model_name}

    def collect(self):
        s = self.engine.stats()
        names, values = list(self.labels), list(self.labels.values())
        for name, doc, value in (
                ("num_requests_running", "Requests holding a slot (prefilling or decoding).", s.running),
                ("num_requests_waiting", "Requests submitted and waiting for a slot.", s.waiting),
                ("slots_used", "Cache slots held by running requests.", s.running),
                ("slots_total", "Cache slots (the most requests that run at once).", s.num_slots),
                ("kv_blocks_used", "KV blocks held by running requests.", s.used_blocks),
                ("kv_blocks_total", "KV blocks of the cache.", s.num_blocks),
                ("kv_cache_usage_ratio", "Fraction of the KV blocks in use (1 = full).",
                 s.used_blocks / s.num_blocks if s.num_blocks else 0.0)):
            gauge = GaugeMetricFamily(PREFIX + name, doc, labels=names)
            gauge.add_metric(values, value)
            yield gauge
        steps = CounterMetricFamily(PREFIX + "engine_steps", "Steps the engine loop has run.", labels=names)
        steps.add_metric(values, s.steps)
        yield steps
        if s.speculative is not None:
            for name, doc, key in SPECULATIVE:
                counter = CounterMetricFamily(PREFIX + name, doc, labels=names)
                counter.add_metric(values, s.speculative[key])
                yield counter


class ServerMetrics:
    """The registry of one app and the per-request metrics its endpoints feed."""

    def __init__(self, engine, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine, model_name))
        label = ["model_name"]
        r, name = self.registry, model_name

        def hist(metric, doc, buckets):
            return Histogram(PREFIX + metric, doc, label, buckets=buckets, registry=r).labels(name)

        def counter(metric, doc):
            return Counter(PREFIX + metric, doc, label, registry=r).labels(name)

        self.ttft = hist("time_to_first_token_seconds", "Seconds from a request's arrival to its first new token.",
                         TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Seconds between two outputs of a request (each output "
                        "of the engine: one token).", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Seconds from a request's arrival to its end.", E2E_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of the requests that ended.")
        self.generation_tokens = counter("generation_tokens", "New tokens of the requests that ended.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache (not prefilled "
                                   "again).")
        finished = Counter(PREFIX + "request_finished", "Requests that ended, by finish reason ('abort': the "
                           "client went away; 'error': the request failed).", label + ["finished_reason"],
                           registry=r)
        self.finished = {reason: finished.labels(name, reason) for reason in FINISH_REASONS}
        # the same counts as plain numbers, for the serve tool's report at exit
        self.totals = dict.fromkeys(FINISH_REASONS + ("prompt_tokens", "generation_tokens"), 0)

    def _ended(self, reason: str, prompt_tokens: int, generation_tokens: int) -> None:
        self.finished[reason].inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        self.totals[reason] += 1
        self.totals["prompt_tokens"] += prompt_tokens
        self.totals["generation_tokens"] += generation_tokens

    def request(self) -> "RequestMetrics":
        return RequestMetrics(self)


class RequestMetrics:
    """One engine request's timings, from its arrival (construction) to its end (finish / fail)."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self.arrival = self.last = time.perf_counter()
        self.first = None
        self.tokens = 0  # new tokens counted so far
        self.ended = False

    def output(self, tokens: int) -> None:
        """An output of `tokens` new tokens reached the server (per token: only the latency histograms)."""
        if not tokens:
            return
        self.tokens += tokens
        now = time.perf_counter()
        if self.first is None:
            self.first = now
            self.metrics.ttft.observe(now - self.arrival)
        else:
            self.metrics.itl.observe(now - self.last)
        self.last = now

    def finish(self, result) -> None:
        """The request ended: `result` is its GenerationResult (finish_reason "abort" for an aborted one: its
        tokens include those nobody read)."""
        if self.ended:
            return
        self.ended = True
        m = self.metrics
        m.e2e.observe(time.perf_counter() - self.arrival)
        m.prefix_queries.inc(result.prompt_tokens)
        m.prefix_hits.inc(getattr(result, "cached_tokens", 0) or 0)
        m._ended(result.finish_reason if result.finish_reason in m.finished else "error", result.prompt_tokens,
                 max(len(result.token_ids), self.tokens))

    def fail(self, prompt_tokens: int) -> None:
        """The request failed (its step's error, the engine shut down)."""
        if self.ended:
            return
        self.ended = True
        self.metrics._ended("error", prompt_tokens, self.tokens)
