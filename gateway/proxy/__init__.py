"""One request's trip: run the pinned snapshot's ``on_request`` hooks, call the chosen worker, and carry the
answer back through ``on_response``/``on_chunk`` (``forward``); streams that no plugin watches are relayed
as bytes, straight from the worker's connection to the client's (``passthrough``). A Responses API or
Anthropic Messages request, translated to chat, takes the same trip and is translated back
(``translated_turn``, ``responses_turn``, ``messages_turn``).

May import pipeline, upstream, wire, ops and infra; imported by ``gateway.server`` and by ``gateway.batch``
(whose runner sends batch lines through it in-process).
"""
