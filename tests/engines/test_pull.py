"""Pull-mode prefill/decode through the router on real vLLM engines (one pair for the module): outputs equal a
single engine's."""
from __future__ import annotations

import pytest

from support.engines import advertised, await_log, await_status, check_outputs, kv_moved, log_lines, metric

pytestmark = pytest.mark.engines


class TestPull:
    def test_outputs_equal_a_single_engine_streaming_and_not(self, pull_pair, reference):
        await_status(pull_pair.router.url + "/health")
        check_outputs(pull_pair.router.url, reference, kv_moved(pull_pair.prefill, pull_pair.decode, "pull"))
        # The decode's READs started before each step's forward (the plugin on CPU engines), and its outputs still
        # equal a single engine's: no READ landed in a block before vLLM had zeroed it.
        assert log_lines(pull_pair.decode, "KV transfers start before its forward")
        assert metric(pull_pair.router.url, "disagg_router_handoff_seconds_count", mode="pull") >= 8
        # Pull decode handshakes with prefill ahead of time over the side channel (pull needs the clock offset
        # only that round trip measures); both engines advertise.
        await_log(pull_pair.decode, f"pre-warmed prefill engine {pull_pair.prefill.spec.engine_id}")
        ads = advertised(pull_pair.rendezvous.url)
        assert {ads[e.spec.engine_id].kv_mode for e in (pull_pair.prefill, pull_pair.decode)} == {"pull"}
