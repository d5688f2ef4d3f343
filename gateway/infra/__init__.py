"""Protocol code this project owns, each behind a small interface and measured against the library it
replaces: an HTTP/1.1 client on httptools (``http1``), Redis auto-pipelining on hiredis
(``redis_autopipe``), and the chunked writer onto uvicorn's transport (``chunked_writer``).

Imports nothing from the rest of the gateway.
"""
