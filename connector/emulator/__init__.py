"""The engine emulator: a stand-in for a vLLM prefill or decode engine at fleet size. It is an emulator, not an
engine, and says so wherever a human looks (its model card, its log, `disagg_emulator_info`, its pods' label).

It speaks what the router, the operator and the tests use of vLLM (the OpenAI API, `/metrics` with vLLM's names,
both P/D legs with the kv_transfer_params of vLLM's push and pull connectors, KV events in vLLM's ZMQ format) and
advertises itself to the rendezvous as the plugin does. It computes no tokens: its time is a continuous-batching
step model fitted to real engines (`profiles`), over a KV cache of blocks with a prefix cache.

Modules, deciding apart from acting:
- pure: `profiles` (the parameters, as data), `tokens` (the emulated tokenizer and text), `prefix_cache` (blocks,
  LRU, hashes and the events they cause), `scheduler` (what one step runs, and what it costs), `openai_format`
  (request parsing and vLLM's response shapes), `kv_event_wire` (its events as the KV event
  structs of connector/wire/kv_events);
- state: `requests` (a request's tokens, blocks and outputs);
- acting: `engine` (the step loop), `handoff` (both sides of a P/D request's KV handoff) over `side_channel` (the
  emulated side channel between emulators), `kv_events` (the ZMQ publisher), `metrics`, `server` (the HTTP app),
  `main` (wiring, the rendezvous).
"""
