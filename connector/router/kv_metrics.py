"""The router's KV index and its event subscriptions as Prometheus metrics (`disagg_router_kv_*`), read at scrape
time from the index's counters (cumulative, engines removed included) and the follower's (stopped subscriptions
included), so no counter ever goes back. Issue 36 counts a benchmark or test only when events were applied."""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .kv_follow import KvFollower

ROLES = ("prefill", "decode")

_INDEX_COUNTERS = (
    ("events_applied", "KV events applied to the index (a test or benchmark of prefix-aware routing counts "
                       "only when this is above 0)"),
    ("batches_applied", "KV event batches applied to the index, in sequence order"),
    ("gaps", "Batches that arrived after missing ones (each is filled by a replay or resets the engine)"),
    ("duplicates", "Batches ignored as already applied (a replay overlapping the live stream)"),
    ("resets", "Times an engine's index was forgotten: an unfilled gap, an engine restart, a bad frame"),
    ("clears", "AllBlocksCleared events applied"),
    ("blocks_stored", "Blocks the index stored from BlockStored events"),
    ("blocks_removed", "Blocks the index dropped on BlockRemoved events"),
    ("blocks_skipped", "Stored blocks the index could not key (unknown parent, LoRA, extra keys, another "
                       "medium or block size)"),
    ("blocks_evicted", "Blocks dropped at --kv-index-max-blocks-per-engine (least recently stored first): "
                       "predictions only get shorter"),
)


class KvMetrics(Collector):
    def __init__(self, follower: KvFollower) -> None:
        self.f = follower

    def collect(self) -> list[Metric]:
        f, c = self.f, self.f.index.counters
        out: list[Metric] = [CounterMetricFamily(f"disagg_router_kv_{name}", doc, value=getattr(c, name))
                             for name, doc in _INDEX_COUNTERS]
        subs = f.counters()
        replays = CounterMetricFamily("disagg_router_kv_replays", "Replays asked for to fill a gap, by whether they "
                                      "filled it (unfilled: the engine's index was reset)", labels=["outcome"])
        replays.add_metric(["filled"], subs.gaps_filled)
        replays.add_metric(["unfilled"], subs.gaps_unfilled)
        out += [replays,
                CounterMetricFamily("disagg_router_kv_restarts", "Engines seen restarting (their event seq went "
                                    "back): each reset the engine's index", value=subs.restarts),
                CounterMetricFamily("disagg_router_kv_bad_frames", "KV event messages that did not decode",
                                    value=subs.bad_frames),
                CounterMetricFamily("disagg_router_kv_frames", "Live KV event messages received", value=subs.frames)]
        changes = CounterMetricFamily("disagg_router_kv_subscription_changes", "Event streams subscribed to (start) "
                                      "and unsubscribed from (stop: withdrawn or re-advertised)", labels=["change"])
        changes.add_metric(["start"], f.started)
        changes.add_metric(["stop"], f.stopped)
        engines_by_role, blocks_by_role = f.by_role()
        engines = GaugeMetricFamily("disagg_router_kv_engines", "Engine event streams subscribed and indexed (one per "
                                    "data-parallel rank)", labels=["role"])
        blocks = GaugeMetricFamily("disagg_router_kv_blocks", "KV blocks the index holds", labels=["role"])
        for role in ROLES:
            engines.add_metric([role], engines_by_role[role])
            blocks.add_metric([role], blocks_by_role[role])
        out += [changes, engines, blocks,
                GaugeMetricFamily("disagg_router_kv_engines_catching_up", "Engine event streams still replaying "
                                  "what their engine published before they were subscribed", value=f.catching_up()),
                GaugeMetricFamily("disagg_router_kv_engines_unindexed", "Engine event streams advertised but not "
                                  "indexed: the index is at --kv-index-max-engines", value=len(f.unindexed)),
                GaugeMetricFamily("disagg_router_kv_index_bound_bytes", "The most the index's blocks may cost: "
                                  "--kv-index-max-engines x --kv-index-max-blocks-per-engine x the bytes a block "
                                  "costs at most", value=f.index.index_bound_bytes)]
        return out
