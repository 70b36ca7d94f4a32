"""The contract between the operator, the engines (the plugin), the rendezvous and the router.

`advertisement`: the rendezvous' wire types. `kv_metadata`: how an engine's NIXL handshake payloads ride in an
advertisement. `env`: every env name the operator sets for engine containers and the engines read, with the
defaults both sides assume. `kv_events`: vLLM's KV cache events (structs and ZMQ framing), which the engine
emulator publishes and the router's index reads. Both sides import these; nothing restates them.
"""
