"""Per-role scale: each role's DisaggregatedRole (role_api.py), whose /scale subresource `kubectl scale`, an HPA or
KEDA write. `counts` decides which count each role runs (the CR's spec.<role>.replicas or the role object's), and
`objects` builds and reads the role objects. Pure: scale_executor.py performs the writes, and the rollout applies
the counts."""
