"""The application: what the daemon does for its callers, whichever front end they used.

No gRPC, no wire format: the front ends (``hicached.frontends``) decode calls and run them
here.

- ``calls``: the method table (``METHODS``): every RPC once, its typed request and result,
  its handler and gates.
- ``views``: read models the front ends render: pools, sessions, the daemon's info, a pool's
  events.
- ``daemon``: ``Daemon``, the state one process serves and the flows of its calls.
- ``sessions``: worker sessions with leases, reaped when workers go quiet.
- ``pool_table`` / ``pool_build``: named pools under one memory budget, built in the
  background.
- ``memory_budget`` / ``budget_config``: the budget shared by the pools by demand
  (``[budget] elastic``): shares that grow and shrink, floors, ceilings, tenants.
- ``admission``: the data path's bound and the fast path's frame budget.
- ``request_bounds``: the largest legal request of each keyed call, refused unread above it.
- ``identity``: who a caller is (``Peer``), what it handed over (``Grant``), who may use which
  pool (``AccessRule``).
"""
