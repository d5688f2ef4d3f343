"""Protocol code this project owns, each behind a small interface and measured against the library it
replaces:

- HTTP/1.1 to workers: the interface ``http_api.HttpClient``; ``http1`` (asyncio + httptools, the default;
  its connection in ``http1_connection``, its keep-alive pool in ``http1_pool``) and ``http_aiohttp``
  (aiohttp's client session, the library it replaces; ``GATEWAY_UPSTREAM_CLIENT``).
- Redis pipelining for plugins: the interface ``redis_api.RedisPipeline``; ``redis_autopipe`` (hiredis,
  the default) and ``redis_py`` (redis-py's pipeline; ``GATEWAY_REDIS_CLIENT``).
  ``redis_script.ScriptCall``: a script call whose keys and trailing arguments are packed once.
- ``chunked_writer``: the chunked writer onto uvicorn's transport.
- ``deadlines``: time bounds that all last the same time on one timer, ``asyncio.timeout``'s behaviour
  without a timer per use (``bench/bench_deadlines.py``; ``tests/infra/test_deadlines.py`` runs the same
  cases through both).

``tests/infra/conformance/`` runs the same cases against both implementations of each interface;
``bench/bench_clients.py`` measures them side by side.

Imports nothing from the rest of the gateway.
"""
