"""The ASGI side: the app factory (``app``), uvicorn's entry (``asgi``), routes (``routes/``), the
process state the routes share (``state``), SIGTERM drain (``drain``) and admin auth (``admin_auth``).

Thin by design: a route parses, calls one function of a lower layer, and translates the result.
May import every layer below it (proxy, pipeline, upstream, wire, ops, infra, engine); only ``gateway.cli``
imports it.
"""
