"""The router as ASGI: the middleware, the routed and hop requests, the response tap, the admin
endpoints and the standalone app.
"""
