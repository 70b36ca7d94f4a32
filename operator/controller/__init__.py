"""The operator's control loop, read in this order:

- settings.py: the one typed settings object, from the command line;
- handlers.py: kopf's watch events become passes on the queue (nothing else is decided there);
- runtime.py: the Controller, which holds the state, feeds the queue and runs the background loops;
- queue.py: the one work queue: one pass per CR at a time, a bound on passes at once, retries;
- reconcile.py: one pass, top to bottom, returning the status and Events it wants written, and writing them;
- indexes.py, observe.py, events.py: what the passes read, and how Events are posted.

The decisions themselves are pure functions elsewhere in the operator (builders, plan, status, rollout, scale,
autoscaling); the writes are the executors' (reconciler, rollout_executor, scale_executor, autoscale_executor).
"""
