"""``kvstore dashboard``: a live cache-hit web page over the nodes' ``/metrics``, and over the
engines of the conductors in front of them (their ``/conductor/state``).

Modules: :mod:`~kvstore.dashboard.scrape` (one node's metrics → numbers),
:mod:`~kvstore.dashboard.model` (the cluster's sums and history),
:mod:`~kvstore.dashboard.conductors` (conductors' states → their engines, merged by id),
:mod:`~kvstore.dashboard.server` (the poller, node sources and HTTP server),
:mod:`~kvstore.dashboard.cli` (the subcommand); the page itself is ``static/``
(plain HTML, CSS and JavaScript with hand-drawn SVG charts: no CDN, no build step).
"""
