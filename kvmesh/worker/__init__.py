"""The worker side of kvmesh: what every backend serves, whatever engine it wraps.

The mock engine, the vLLM adapter, and any future SGLang / TensorRT-LLM adapter or custom engine
all serve the same worker RPCs to the router, keep pins and sessions within the same budget rules,
and answer ``kv_state`` in the same shape. The engine-agnostic parts live here:

* ``rpc`` — the ``/kvmesh/*`` Starlette routes over a :class:`~kvmesh.worker.rpc.WorkerBackend`,
  their validation and the admin-token check;
* ``retention`` — one ledger of pinned prefixes and open sessions (TTLs, sliding idle timeouts, a
  distinct-block budget with an explicit over-budget policy) that tells the engine which block
  references to take and drop;
* ``block_state`` — the cached-block set rebuilt from an engine's own KV events, for ``kv_state``.

Layering: the same level as ``kvmesh.router`` (it uses ``kvmesh.events`` and the leaves); the router
and the worker side never import each other, they only talk over HTTP and ZMQ.
"""
