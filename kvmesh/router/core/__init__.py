"""The routing core: which worker should serve a request, decided without I/O.

Pure by rule (tests/test_layering.py): no clock, no sockets, no randomness of its own; time and the
random generator are arguments. ``kv_router.KvRouter`` ties the prefix index, the load model, the
selector, the admission queue and session affinity together, and runs each decision's loop over
the candidates; ``route_types`` holds what it takes and returns, ``config.RouterConfig`` every
routing flag. The latency cost's parts: ``timing`` (each worker's fitted curve), ``latency_cost``
(the prices beyond a candidate's own predicted time to first token, and the tie rule),
``observations`` (what the fits learn from, request by request), ``stays`` (how long requests
stay), ``router_state`` (the pieces those parts share), ``conversations``, ``joins``, ``copies``,
``wait_spread`` and ``tail`` (the fleet's observed times to first token, whose 99th percentile
bounds where a request may be sent). The prefix indexes share ``index.KvIndex``: ``chain_trie`` is the structure
under all of them, ``event_index``, ``approx_index`` and ``predicted_index`` the variants,
``index_factory`` picks one from the config.
"""

from kvmesh._native import activate

# Its modules compiled with mypyc where a build of these very sources exists (kvmesh native build).
activate(__name__, __path__)
