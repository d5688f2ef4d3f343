"""An OpenAI-compatible gateway in front of vLLM workers.

The packages are layers; each imports only from the layers below it (``tests/architecture`` checks it):

- ``gateway.cli``: the ``gateway`` command (serve, check-config, reload, model prepare, config schema).
- ``gateway.server``: the ASGI side: app factory, routes (OpenAI, admin, health, models), drain, admin auth.
- ``gateway.batch``: the Files and Batch APIs and the runner of batch lines on idle capacity.
- ``gateway.proxy``: one request's trip: run the pipeline, call the chosen worker, stream the answer back.
- ``gateway.pipeline``: the plugin contract (``gateway.pipeline.plugin``: read this first to write a plugin),
  the request context, the hook loop, the registry, config models, the runtime snapshot and reload.
- ``gateway.upstream``: talking to workers: the pooled client and the worker table with health and load.
- ``gateway.wire``: the OpenAI protocol: request checks, the parameter allow-list, errors, SSE framing.
- ``gateway.ops``: process settings, metrics, logs, traces, task helpers.
- ``gateway.infra`` and ``gateway.engine``: protocol code the project owns (HTTP/1.1 client, Redis
  auto-pipelining, the client-side chunked writer) and the managed vLLM workers.

Built-in plugins live in the top-level ``plugins`` package and are found through entry points like any
third-party plugin: nothing here imports them.
"""
