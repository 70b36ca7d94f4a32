"""The contract between the operator, the engines (the plugin), the rendezvous and the router.

`advertisement`: the rendezvous' wire types. `kv_metadata`: how an engine's NIXL handshake payloads ride in an
advertisement. `env`: every env name the operator sets for engine containers and the engines read, with the
defaults both sides assume. Both sides import these; nothing restates them.
"""
