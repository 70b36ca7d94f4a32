"""The wire types shared by engines, the rendezvous and the router."""
from __future__ import annotations

import base64
import json

import pytest
from pydantic import ValidationError

from disagg.connector.wire.advertisement import (
    MAX_KV_METADATA_BYTES,
    EngineAdvertisement,
    EngineList,
    WatchEvent,
    check_engine_id,
)
from support.rendezvous import advert, advert_json


def _error(**over) -> str:
    data = advert_json()
    data.update(over)
    with pytest.raises(ValidationError) as e:
        EngineAdvertisement.model_validate(data)
    return str(e.value)


def test_valid_advertisement_round_trips_through_json():
    a = advert(role="decode", kv_metadata=base64.b64encode(b"\x00meta").decode(), dp_size=2,
               side_channel_ports=[5600, 5601], pod_name="qwen-decode-0", pod_uid="6f1d2c3a-1b2c")
    assert EngineAdvertisement.model_validate_json(a.model_dump_json()) == a
    assert a.side_channel_port == 5600


def test_engine_id_charset():
    assert check_engine_id("qwen-decode-0-6f1d2c3a-1b2c-4d5e-8f90-0123456789ab")
    for bad in ("", "-x", "a/b", "a b", "a?b", "ä", "x" * 321):
        assert "engine_id" in _error(engine_id=bad), bad


@pytest.mark.parametrize("field,value,needle", [
    ("side_channel_ports", [0], "greater than or equal to 1"),
    ("side_channel_ports", [65536], "less than or equal to 65535"),
    ("side_channel_ports", [], "at least 1"),
    ("side_channel_ports", [5600, 5601], "one port per data-parallel rank"),
    ("tp_size", 0, "greater than or equal to 1"),
    ("pp_size", 0, "greater than or equal to 1"),
    ("dp_size", 0, "greater than or equal to 1"),
    ("block_size", 0, "greater than or equal to 1"),
    ("tp_size", "4", "valid integer"),            # strict: no string coercion
    ("tp_size", True, "valid integer"),           # strict: a bool is not a size
    ("http_url", "ftp://10.0.0.5:8000", "http or https"),
    ("http_url", "10.0.0.5:8000", "http or https"),
    ("http_url", "http://:8000", "no host"),
    ("http_url", "http://10.0.0.5:99999", "not a URL"),
    ("http_url", "http://10.0.0.5:8000/v1", "no path"),
    ("role", "router", "prefill"),
    ("kv_mode", "both", "push"),
    ("lease_seconds", 0, "greater than or equal to 0.1"),
    ("lease_seconds", 1e9, "less than or equal to 3600"),
    ("lease_seconds", float("nan"), "finite number"),
    ("deployment", "", "must not be empty"),
    ("layout_key", "a b", "may only contain"),
    ("side_channel_host", "a/b", "not a host"),
    ("kv_metadata", "not base64!", "not valid base64"),
    ("kv_metadata", 42, "kv_metadata"),
    ("surprise", 1, "Extra inputs are not permitted"),
    ("kv_events_endpoints", ["tcp://*:5557"], "tcp://host:port"),
    ("kv_events_endpoints", ["tcp://10.0.0.5"], "tcp://host:port"),
    ("kv_events_endpoints", ["ipc:///tmp/kv"], "tcp://host:port"),
    ("kv_events_endpoints", ["tcp://10.0.0.5:5557/x"], "tcp://host:port only"),
    ("kv_events_endpoints", ["tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558"], "one endpoint per data-parallel"),
    ("kv_events_endpoints", [], "at least 1"),
    ("kv_events_replay_endpoints", ["tcp://10.0.0.5:0"], "tcp://host:port"),
    ("kv_events_replay_endpoints", ["tcp://10.0.0.5:5558"], "without kv_events_endpoints"),
])
def test_invalid_fields_are_rejected_with_the_field_named(field, value, needle):
    message = _error(**{field: value})
    assert needle in message and field in message


def test_kv_metadata_is_bounded():
    big = "A" * (MAX_KV_METADATA_BYTES + 4)
    assert "more than" in _error(kv_metadata=big)
    assert "more than" in _error(kv_metadata={"blob": "x" * MAX_KV_METADATA_BYTES})
    ok = advert(kv_metadata={"agent": "nixl", "blocks": [1, 2, 3], "nested": {"none": None}})
    assert json.loads(ok.model_dump_json())["kv_metadata"]["nested"] == {"none": None}


def test_http_url_trailing_slash_is_normalised():
    assert advert(http_url="https://decode.example:8443/").http_url == "https://decode.example:8443"


def test_watch_event_engine_presence_matches_type():
    WatchEvent(version=1, type="BOOKMARK", epoch="e")
    WatchEvent(version=1, type="ADDED", engine=advert())
    with pytest.raises(ValidationError, match="need engine"):
        WatchEvent(version=1, type="EXPIRED")
    with pytest.raises(ValidationError, match="take no engine"):
        WatchEvent(version=1, type="RESET", engine=advert())
    with pytest.raises(ValidationError):
        WatchEvent(version=-1, type="BOOKMARK")


def test_engine_list_forbids_unknown_fields():
    EngineList(version=0, epoch="e", warming=False, engines=[advert()])
    with pytest.raises(ValidationError, match="Extra inputs"):
        EngineList.model_validate({"version": 0, "epoch": "e", "warming": False, "engines": [], "x": 1})



# What engines sent before the KV events fields existed, exactly: the plugin's PUT body (`model_dump_json()`, None
# fields included) and an older rendezvous' watch line (`exclude_none`).
OLD_PUT = {"role": "decode", "engine_id": "qwen-decode-0-uid1-3f2a", "deployment": "qwen",
           "pod_name": "qwen-decode-0", "pod_uid": "uid1", "http_url": "http://10.0.0.7:8000",
           "side_channel_host": "10.0.0.7", "side_channel_ports": [5600], "tp_size": 4, "pp_size": 1, "dp_size": 1,
           "block_size": 128, "layout_key": "0123456789abcdef", "kv_mode": "push", "transport": "UCX",
           "kv_metadata": None, "lease_seconds": 15.0}
OLD_WATCH_LINE = ('{"version":3,"type":"ADDED","engine":{"role":"prefill","engine_id":"qwen-prefill-0-uid0-9c1d",'
                  '"deployment":"qwen","http_url":"http://10.0.0.5:8000","side_channel_host":"10.0.0.5",'
                  '"side_channel_ports":[5600],"tp_size":4,"pp_size":1,"dp_size":1,"block_size":128,'
                  '"layout_key":"0123456789abcdef","kv_mode":"push","transport":"UCX","lease_seconds":15.0}}')


def test_advertisements_from_before_the_kv_events_fields_still_parse():
    """A rolling upgrade mixes versions: engines of an older revision keep their plugin and advertise without the
    fields, to the rendezvous (its parser) and through it to routers (a watch line)."""
    from disagg.connector.rendezvous.server import parse_advertisement

    old = parse_advertisement(json.dumps(OLD_PUT).encode())
    assert old.kv_events_endpoints is None and old.kv_events_replay_endpoints is None
    assert old == EngineAdvertisement.model_validate(OLD_PUT)
    event = WatchEvent.model_validate_json(OLD_WATCH_LINE)
    assert event.engine is not None and event.engine.kv_events_endpoints is None


async def test_an_advertisement_without_events_is_sent_as_an_older_rendezvous_accepts_it():
    """Every model forbids unknown fields, so an older rendezvous or router refuses a key it does not know, even a
    null one: what the client PUTs, and what the rendezvous serves, name a new field only when it is set."""
    from disagg.connector.rendezvous.client import RendezvousClient

    sent: list[bytes] = []

    class Capture(RendezvousClient):
        async def _call(self, method, path, *, body=None, auth=False, params=None, ok=(200,)):
            sent.append(body)
            return 200, json.dumps({"version": 1, "result": "created", "engine": json.loads(body),
                                    "expires_in": 15.0}).encode()

    client = Capture("http://rendezvous:8080")
    plain = EngineAdvertisement.model_validate(OLD_PUT)
    await client.register(plain)
    assert set(json.loads(sent[-1])) <= set(OLD_PUT), "nothing an older rendezvous would refuse"
    with_events = plain.model_copy(update={"kv_events_endpoints": ["tcp://10.0.0.7:5557"],
                                           "kv_events_replay_endpoints": ["tcp://10.0.0.7:5558"]})
    await client.register(with_events)
    assert EngineAdvertisement.model_validate_json(sent[-1]) == with_events
    line = WatchEvent(version=1, type="ADDED", engine=plain).model_dump_json(exclude_none=True)  # the server's
    assert "kv_events" not in line


def test_kv_events_endpoints_round_trip_one_per_rank():
    a = advert(dp_size=2, side_channel_ports=[5600, 5601],
               kv_events_endpoints=["tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558"],
               kv_events_replay_endpoints=["tcp://[fd00::5]:5559", "tcp://[fd00::5]:5560"])
    assert EngineAdvertisement.model_validate_json(a.model_dump_json()) == a
    events_only = advert(kv_events_endpoints=["tcp://decode-0.qwen-decode:5557"])
    assert events_only.kv_events_replay_endpoints is None
