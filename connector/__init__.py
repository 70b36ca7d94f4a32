"""Everything beside vLLM or in the request path, as three programs over one wire contract:

- `plugin`: runs inside a vLLM engine (advertise, pre-warm peers, WRITE warm-up);
- `rendezvous`: where engines advertise themselves (server, auth, registry) and the client engines and routers use;
- `router`: the OpenAI-compatible endpoint that pairs prefill and decode engines;
- `wire`: the advertisement, the KV metadata encoding and every env name the operator sets for engines.

Never imports `disagg.operator` (an import-linter contract in pyproject.toml enforces it).
"""
