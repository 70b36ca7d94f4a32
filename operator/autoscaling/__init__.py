"""The built-in autoscaling planner: `observed` (the window of load it reads), `window` (per-request samples into
that window), `scrape` (that window and the engines' load from the routers' and engines' `/metrics` text), `policy`
(spec.autoscaling as the planner reads it), `decision` (what it returns) and `planner` (the pure decision).

Nothing here touches the cluster, the router or the engines: a caller observes (fetching the metric text itself),
calls `planner.decide`, and applies the counts it gets through the rollout machinery."""
