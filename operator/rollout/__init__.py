"""Version-safe, coordinated prefill/decode rollouts and scaling: `state` (what the planner observes and the
policy it follows), `steps` (the plan it returns), `planner` (the pure decision) and `simulate` (a healthy world
applying the steps, for tests and for reading a whole rollout before running it).

Nothing here touches the cluster: the executor observes, calls `planner.plan`, and applies the one step it
gets."""
