"""The routing core: which worker should serve a request, decided without I/O.

Pure by rule (tests/test_layering.py): no clock, no sockets, no randomness of its own; time and the
random generator are arguments. ``kv_router.KvRouter`` ties the prefix index, the load model, the
selector, the admission queue and session affinity together; ``config.RouterConfig`` holds every
routing flag. The prefix indexes share ``index.KvIndex``: ``chain_trie`` is the structure under all
of them, ``event_index``, ``approx_index`` and ``predicted_index`` the variants, ``index_factory``
picks one from the config.
"""
