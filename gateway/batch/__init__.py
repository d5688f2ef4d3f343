"""The batch lane: the OpenAI Files and Batch APIs, run on the fleet's idle capacity.

- ``blobs``: where file contents live (a directory by default; the ``BlobStore`` interface for others).
- ``files``: file objects, metadata in Redis, per caller scope.
- ``usage``: what each scope stores, counted and bounded; uploads reserve room before they write.
- ``jobs``: batch objects and their status lifecycle in Redis.
- ``lines``: input lines checked and ordered by shared prefix; output lines in OpenAI's shapes.
- ``work``: the lines as shared work: leases any replica may take over, each result written once.
- ``lifecycle``: validation and finalization (output and error files).
- ``capacity``: whether a line may be sent now (idle capacity only).
- ``submit``: the one adapter onto the request path (a line through ``Proxy.serve``, in-process).
- ``runner``: one per replica, working off every replica's batches.
- ``service``: all of it with the app's lifetime; ``metrics``: what operators see.

A layer between ``server`` (the routes call it) and ``proxy`` (lines go through it); may import every
layer below ``server``.
"""
