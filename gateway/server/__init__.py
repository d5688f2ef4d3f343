"""The ASGI side: the app factory (``app``), its start-up and shutdown (``lifecycle``), the admin API's
own port (``admin_port``), the error answers outside the hot routes (``errors_asgi``), uvicorn's entry
(``asgi``), routes (``routes/``), the process state the routes share (``state``), SIGTERM drain
(``drain``), admin auth (``admin_auth``), the Responses API's store of responses in Redis
(``responses_store``) and the operator console's page and playground (``console/``).

Thin by design: a route parses, calls one function of a lower layer, and translates the result.
May import every layer below it (proxy, pipeline, upstream, wire, ops, infra, engine); only ``gateway.cli``
imports it.
"""
