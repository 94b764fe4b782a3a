"""kvmesh's own HTTP/1.1 client towards workers: wire parsing, pooled keep-alive connections, the forwarder.

asyncio only; it knows nothing of ASGI, so the fleet runtime and the middleware share one client.
"""
