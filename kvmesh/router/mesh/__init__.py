"""The fleet runtime: settings, the worker registry and its health, KV-event feeds and cold start,
replica sync and metrics. asyncio and ZMQ; no ASGI.
"""
