"""The emulator's `/metrics`: vLLM 0.32's metric families (names, types, labels and buckets from
v1/metrics/loggers.py, v1/metrics/buckets.py and the NIXL connector's stats.py), fed by the step loop, plus
`disagg_emulator_info`, which says that an emulator serves them.

What an autoscaler, a router or a test reads of a real engine reads the same here: the queue
(`vllm:num_requests_running`, `vllm:num_requests_waiting`), `vllm:kv_cache_usage_perc`, the token counters (by
source: computed, local prefix-cache hit, received over the KV transfer), TTFT, inter-token and per-request
latencies, prefix-cache queries and hits, and the KV transfers' `vllm:nixl_xfer_time_seconds` on the engine that
drives them (push: the prefill; pull: the decode). tests/emulator/test_wire_format.py holds every family to a
recorded real engine's.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..wire import emulator as contract

if TYPE_CHECKING:
    from .engine import Request

LABELS = ("model_name", "engine")
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
XFER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
XFER_BYTES_BUCKETS = tuple(2 ** (10 + i) for i in range(1, 25, 2))
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def token_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's request-token buckets: 1, 2, 5, 10, 20, 50, ... up to max_model_len."""
    out: list[int] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10 ** exponent
            if value > max_model_len:
                return tuple(out)
            out.append(value)
        exponent += 1


class EngineMetrics:
    """One emulated engine's metrics, in a registry of its own."""

    def __init__(self, model_name: str, *, profile: str, role: str, kv_mode: str, max_model_len: int,
                 block_size: int, num_blocks: int, kv_bytes_per_token: int) -> None:
        self.registry = r = CollectorRegistry()
        labels = {"model_name": model_name, "engine": "0"}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, LABELS, registry=r, multiprocess_mode="mostrecent").labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=r).labels(**labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=r).labels(**labels)

        Gauge("disagg_emulator_info", "This is the disagg engine emulator, not a vLLM engine: its timing is a model "
              "fitted to real engines (connector/emulator/profiles.py)", ["profile", "role", "kv_mode", "owner"],
              registry=r).labels(profile=profile, role=role, kv_mode=kv_mode, owner=contract.OWNER).set(1)
        info = cache_config_info(block_size, num_blocks, max_model_len, kv_bytes_per_token)
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", list(info), registry=r,
              multiprocess_mode="mostrecent").labels(**info).set(1)
        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        by_reason = Gauge("vllm:num_requests_waiting_by_reason", "Number of waiting requests by reason. Reason "
                          "labels: 'capacity' = waiting for scheduling capacity; 'deferred' = deferred by transient "
                          "constraints (LoRA budget, KV transfer, blocked status). Sum of all reasons equals "
                          "vllm:num_requests_waiting.", [*LABELS, "reason"], registry=r, multiprocess_mode="mostrecent")
        self.waiting_capacity = by_reason.labels(model_name, "0", "capacity")
        self.waiting_deferred = by_reason.labels(model_name, "0", "deferred")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.cache_queries = counter("vllm:prefix_cache_queries",
                                     "Prefix cache queries, in terms of number of queried tokens.")
        self.cache_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.external_queries = counter("vllm:external_prefix_cache_queries",
                                        "External prefix cache queries from KV connector cross-instance cache "
                                        "sharing, in terms of number of queried tokens.")
        self.external_hits = counter("vllm:external_prefix_cache_hits",
                                     "External prefix cache hits from KV connector cross-instance cache sharing, in "
                                     "terms of number of cached tokens.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        by_source = Counter("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
                            [*LABELS, "source"], registry=r)
        self.by_source = {s: by_source.labels(model_name, "0", s) for s in SOURCES}
        self.prompt_cached = counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).")
        cached_by_source = Counter("vllm:prompt_tokens_cached_by_source", "Prefix-cache hit tokens by the cache tier "
                                   "that supplied them: device (local HBM), host (offloaded to DRAM), disk, p2p "
                                   "(transferred from another vLLM instance) or external_unspecified. Counted at "
                                   "admission; sums to vllm:prefix_cache_hits + vllm:external_prefix_cache_hits.",
                                   [*LABELS, "source"], registry=r)
        tiers = ("device", "host", "p2p", "disk", "external_unspecified")
        self.cached_by_source = {s: cached_by_source.labels(model_name, "0", s) for s in tiers}
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*LABELS, "finished_reason"], registry=r)
        self.success = {reason: success.labels(model_name, "0", reason) for reason in ("stop", "length", "abort",
                                                                                       "error")}
        self.request_prompt = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                        token_buckets(max_model_len))
        self.request_generation = histogram("vllm:request_generation_tokens",
                                            "Number of generation tokens processed.", token_buckets(max_model_len))
        self.iteration_tokens = histogram("vllm:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.", ITERATION_BUCKETS)
        self.max_tokens = histogram("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
                                    token_buckets(max_model_len))
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", LATENCY_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.", LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", LATENCY_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", LATENCY_BUCKETS)
        self.request_preemptions = histogram("vllm:request_num_preemptions",
                                             "Number of preemptions for request.", PREEMPTION_BUCKETS)
        self.kv_computed = histogram("vllm:request_prefill_kv_computed_tokens",
                                     "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
                                     token_buckets(max_model_len))
        self.failed_transfers = counter("vllm:nixl_num_failed_transfers",
                                        "Number of failed NIXL KV Cache transfers.")
        self.expired = counter("vllm:nixl_num_kv_expired_reqs",
                               "Number of requests that had their KV expire. NOTE: This metric is tracked on the P "
                               "instance.")
        self.xfer_time = histogram("vllm:nixl_xfer_time_seconds",
                                   "Histogram of transfer duration for NIXL KV Cache transfers.", XFER_BUCKETS)
        self.xfer_bytes = histogram("vllm:nixl_bytes_transferred",
                                    "Histogram of bytes transferred per NIXL KV Cache transfers.", XFER_BYTES_BUCKETS)

    # -- fed by the engine ------------------------------------------------------------------------------------
    def state(self, running: int, waiting: int, deferred: int, usage: float) -> None:
        """The queue and the cache now: `waiting` counts every request not running, `deferred` those waiting for
        their KV."""
        self.running.set(running)
        self.waiting.set(waiting)
        self.waiting_capacity.set(waiting - deferred)
        self.waiting_deferred.set(deferred)
        self.kv_usage.set(usage)

    def step(self, tokens: int) -> None:
        if tokens:
            self.iteration_tokens.observe(tokens)

    def cache_query(self, tokens: int, hits: int) -> None:
        self.cache_queries.inc(tokens)
        self.cache_hits.inc(hits)

    def queued(self, seconds: float) -> None:
        self.queue_time.observe(seconds)

    def first_token(self, ttft: float, req: Request) -> None:
        self.ttft.observe(ttft)
        prompt = len(req.prompt)
        cached = min(prompt, req.local_hit + req.external)
        self.prompt_tokens.inc(prompt)
        self.by_source["local_compute"].inc(prompt - cached)
        self.by_source["local_cache_hit"].inc(req.local_hit)
        self.by_source["external_kv_transfer"].inc(req.external)
        self.prompt_cached.inc(cached)
        self.cached_by_source["device"].inc(req.local_hit)
        self.cached_by_source["p2p"].inc(req.external)
        self.external_queries.inc(prompt - req.local_hit)
        self.external_hits.inc(req.external)
        self.kv_computed.observe(prompt - cached)
        self.generation_tokens.inc()
        if req.scheduled is not None:
            self.prefill_time.observe(max(0.0, (req.first_token or req.scheduled) - req.scheduled))

    def inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)
        self.generation_tokens.inc()

    def finished(self, req: Request, now: float) -> None:
        self.success["length"].inc()
        self.e2e.observe(now - req.arrived)
        self.request_prompt.observe(len(req.prompt))
        self.request_generation.observe(len(req.outputs))
        self.max_tokens.observe(req.max_tokens)
        self.request_preemptions.observe(req.preemptions)
        if req.scheduled is not None:
            self.inference_time.observe(now - req.scheduled)
        if req.first_token is not None:
            self.decode_time.observe(now - req.first_token)
            if len(req.outputs) > 1:
                self.tpot.observe((now - req.first_token) / (len(req.outputs) - 1))

    def preempted(self) -> None:
        self.preemptions.inc()

    def aborted(self) -> None:
        self.success["abort"].inc()

    def failed(self) -> None:
        self.success["error"].inc()

    def transfer_failed(self) -> None:
        self.failed_transfers.inc()

    def lease_expired(self) -> None:
        self.expired.inc()

    def transfer(self, seconds: float, nbytes: int) -> None:
        self.xfer_time.observe(seconds)
        self.xfer_bytes.observe(nbytes)


def cache_config_info(block_size: int, num_blocks: int, max_model_len: int, kv_bytes_per_token: int) -> dict[str, str]:
    """`vllm:cache_config_info`'s labels: vLLM 0.32's CacheConfig, the emulated capacity in the fields that hold it
    and vLLM's defaults in the rest (the labels must be vLLM's for a scraper's queries to match)."""
    tokens = block_size * num_blocks
    return {
        "_block_size_resolved": "True", "block_size": str(block_size), "cache_dtype": "auto",
        "cache_hit_alignment_tokens": "None", "effective_attention_block_size": str(block_size),
        "enable_mamba_shared_prefix_checkpoint": "False", "enable_prefix_caching": "True", "engine": "0",
        "gpu_memory_utilization": "0.92", "hash_block_size": "None", "is_attention_free": "False",
        "kv_cache_dtype_skip_layers": "[]", "kv_cache_layout": "None",
        "kv_cache_max_concurrency": str(round(tokens / max_model_len, 2)),
        "kv_cache_memory_bytes": str(tokens * kv_bytes_per_token), "kv_cache_size_tokens": str(tokens),
        "kv_offloading_backend": "native", "kv_offloading_size": "None", "kv_sharing_fast_prefill": "False",
        "mamba_block_size": "None", "mamba_cache_dtype": "auto", "mamba_cache_mode": "none",
        "mamba_page_size_padded": "None", "mamba_ssm_cache_dtype": "auto", "num_cpu_blocks": "None",
        "num_gpu_blocks": str(num_blocks), "num_gpu_blocks_override": "None", "prefix_cache_retention_interval": "0",
        "prefix_caching_hash_algo": "sha256", "prefix_match_unit": "None", "replayssm_buffer_len": "16",
        "skip_page_size_padded": "None", "sliding_window": "None", "swa_bounded_replay": "True",
        "use_kda_recoverssm": "False", "use_replayssm": "False", "user_specified_block_size": "True"}
