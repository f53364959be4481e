"""A simulated fleet's parts, sans I/O: engine profiles (:mod:`kvstore.sim.profile`, JSON data
files under ``profiles/``) and an engine model of vLLM v1's scheduler and prefix cache
(:mod:`kvstore.sim.engine`) that a virtual-time loop (:mod:`kvstore.sim.fleet`), or a
real-time server (``kvstore sim serve``, :mod:`kvstore.sim.server`: mock vLLM engines),
steps; the ``pool`` configuration's nodes and connectors (:mod:`kvstore.sim.pool`);
``kvstore sim`` (:mod:`kvstore.sim.cli`)."""
