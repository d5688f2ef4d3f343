"""The operator console: a static page (``static/``: HTML, one script, one stylesheet, no build step, nothing
fetched from elsewhere) served at ``/admin/ui``, and its playground endpoint.

- ``assets``: the files, read once when the app is built, and the security headers every one of them
  carries (a strict Content-Security-Policy, ``nosniff``, no framing, no caching, no referrer).
- ``routes``: where they are served. On the admin port (``GATEWAY_ADMIN_PORT``) the page and its two
  files need no token (they hold no data; the token is typed into the page); on the public port they are
  admin routes like the others (401 without the token, 404 when an admin port is set).
- ``playground``: ``POST /admin/ui/chat``, the page's chat: the admin token in ``x-admin-token``, the rest
  of the request handed to the real ``/v1/chat/completions`` handler.

The page reads everything else from the admin API (``/admin/stats``, ``/admin/workers``, ``/admin/reloads``,
``/admin/config``, ``/admin/config/diff``, ``/admin/plugins/tenancy/...``) with the token in a header:
nothing rides on a cookie, so no other site can make the browser act (CSRF). Everything it shows is
inserted as text (``textContent``), never parsed as HTML.

May import the server's own modules and every layer below the server.
"""
