"""The router: pure routing core, ASGI middleware and the standalone router app."""
