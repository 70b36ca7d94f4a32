"""The OpenAI-compatible router: `app` (HTTP endpoints and dispatch), `engine_pool` (pairing), `pd_protocol`
(what each leg of a P/D request carries) and `flags` (its command-line arguments)."""
