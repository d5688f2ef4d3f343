"""The OpenAI wire: which requests the gateway understands and how it checks them (``protocol``), which
fields a client may send (``allowlist``), media URLs it refuses to let a worker fetch (``media_urls``), the
one error tree and its OpenAI-shaped rendering (``errors``), SSE parsing, assembly and replay
(``streaming``), the OpenAPI document (``openapi``), and the Responses API translated to chat completions
(``responses_request``, ``responses_items``) and back (``responses_output``, and streamed,
``responses_events``).

May import ops, infra and engine; knows nothing of plugins, workers or the server.
"""
