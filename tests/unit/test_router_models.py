"""/v1/models while no decode engine answers it (a deployment scaled to zero, or starting): with
--served-model-name the router names the model itself, so a client that checks the model before sending (SDKs,
benchmark tools) goes on to send, and its request waits for a pair; without it, a 503."""
from __future__ import annotations

import aiohttp
import pytest

from disagg.connector.router.app import Router, Settings
from disagg.connector.router.engine_pool import EnginePool
from support.stub_engines import serving


@pytest.mark.parametrize("name", ["tiny", None])
async def test_models_with_no_engine_names_the_served_model_or_is_a_503(name):
    router = Router(EnginePool("push", lambda: []), Settings(mode="push", served_model_name=name))
    async with serving(router.app()) as url, aiohttp.ClientSession() as s:
        async with s.get(url + "/v1/models") as r:
            body = await r.json()
            if name is None:
                assert r.status == 503 and "no healthy decode engine" in body["error"]["message"]
                return
            assert r.status == 200
    assert [m["id"] for m in body["data"]] == [name] and body["object"] == "list"
    assert body["data"][0]["object"] == "model" and body["data"][0]["owned_by"] == "disagg-router"
