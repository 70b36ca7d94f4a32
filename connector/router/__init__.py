"""The OpenAI-compatible router: `app` (HTTP endpoints and dispatch), `engine_pool` (pairing), `pd_protocol`
(what each leg of a P/D request carries), `flags` (its command-line arguments), `kv_index` (what each engine's
KV cache holds, from its KV events) and `kv_events_client` (the subscriptions that feed it)."""
