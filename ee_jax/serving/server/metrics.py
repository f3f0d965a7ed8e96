"""Prometheus metrics of one server: what was served, how fast, how deep.

Each server has its own `CollectorRegistry` (two servers in one process never share counters).
The engine thread writes, the /metrics handler reads; prometheus_client is thread-safe.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3,
                    0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    """Counters, histograms and gauges named eejax_*; see `render` for the text format."""

    def __init__(self, num_layers: int, num_pages: int):
        r = self.registry = CollectorRegistry()
        self.num_layers = num_layers
        self.requests = Counter("eejax_requests", "Requests that left the engine, by finish "
                                "reason (stop, length, abort, error)", ["finish_reason"],
                                registry=r)
        self.rejected = Counter("eejax_rejected_requests", "HTTP requests refused before "
                                "reaching the engine, by status code", ["status"], registry=r)
        self.prompt_tokens = Counter("eejax_prompt_tokens", "Prompt tokens of requests that "
                                     "left the engine", registry=r)
        self.generation_tokens = Counter("eejax_generation_tokens", "Tokens generated",
                                         registry=r)
        self.ttft = Histogram("eejax_time_to_first_token_seconds", "Arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("eejax_inter_token_latency_seconds", "Time between consecutive "
                             "tokens of one request", buckets=_LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("eejax_request_latency_seconds", "Arrival to finish",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        # Bucket k counts tokens that ran at most k layers; num_layers is full depth.
        self.exit_layer = Histogram("eejax_exit_layer", "Layers run for each generated token",
                                    buckets=tuple(range(1, num_layers + 1)), registry=r)
        self.layers_run = Counter("eejax_layers_run", "Layers run, summed over generated "
                                  "tokens", registry=r)
        self.mean_layers = Gauge("eejax_mean_layers_per_token", "eejax_layers_run_total / "
                                 "eejax_generation_tokens_total", registry=r)
        Gauge("eejax_model_layers", "Layers of the model (full depth)",
              registry=r).set(num_layers)
        self.pages_used = Gauge("eejax_kv_pages_used", "KV-cache pages held by requests",
                                registry=r)
        Gauge("eejax_kv_pages", "KV-cache pages in all (one is the reserved null page)",
              registry=r).set(num_pages)
        self.preemptions = Counter("eejax_preemptions", "Requests preempted (recomputed later) "
                                   "when pages ran out", registry=r)
        self.compiles = Counter("eejax_compiles", "Engine steps that compiled a new program",
                                registry=r)
        self.compile_seconds = Counter("eejax_compile_seconds", "Time spent in steps that "
                                       "compiled", registry=r)
        # From the one exit summary (`ee_jax.serving.stats.exit_summary`), as the CLI prints it.
        self.ideal_speedup = Gauge("eejax_ideal_speedup", "(L + head) / mean cost per decoded "
                                   "token, heads and exit checks counted in layer-equivalents: "
                                   "the ceiling early exit sets for the served speed-up",
                                   registry=r)
        self.work_fraction = Gauge("eejax_work_fraction", "Layers x rows computed by decode "
                                   "steps / the same steps at full depth", registry=r)
        # Verified exits (ExitConfig.verify): drafts made and drafts the full model confirmed.
        self.drafted = Counter("eejax_drafted_tokens", "Drafts the exit heads made (verified "
                               "exits)", registry=r)
        self.accepted = Counter("eejax_accepted_tokens", "Drafts the full model confirmed "
                                "(verified exits)", registry=r)
        self.acceptance = Gauge("eejax_acceptance_rate", "eejax_accepted_tokens_total / "
                                "eejax_drafted_tokens_total", registry=r)
        self.running = Gauge("eejax_requests_in_engine", "Requests in the engine (running or "
                             "waiting)", registry=r)
        self._lock = threading.Lock()
        self._tokens = 0
        self._layers = 0

    def token(self, exit_layer: int) -> None:
        self.generation_tokens.inc()
        self.exit_layer.observe(exit_layer)
        self.layers_run.inc(exit_layer)
        with self._lock:
            self._tokens += 1
            self._layers += exit_layer
            self.mean_layers.set(self._layers / self._tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
