"""The node runtime: one kvstore server process.

`server` assembles a node from its config; `service` is the gRPC servicer, `datachannel` the TCP
bulk path; `manager` owns the tiers' state (holds, movers, tenants, quotas, sessions) and
`ledger` the hit/miss accounting that `metrics` exports.  Nothing outside the node imports this
package except the tools in `kvstore.bench`, `kvstore.traces` and `kvstore.local`, which run real
node code offline.
"""
