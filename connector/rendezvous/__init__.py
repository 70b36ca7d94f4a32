"""The rendezvous: where engines advertise themselves under leases and routers watch them.

`server` (the aiohttp app and its command), `auth` (who may write), `registry` (the leased entries and their
change log) and `client` (what engines and routers use; the only part that engine pods get).
"""
