"""Traces, replay and planning (offline tools): the trace format and its generator, replay through
the node's own tier and policy code (simulated or live), oracle bounds, capacity sweeps, the cost
model and `kvstore plan`."""
