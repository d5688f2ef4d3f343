"""Operating the process: settings from the environment (``settings``), Prometheus metrics (``metrics``),
JSON logs and the access log (``logs``), OpenTelemetry traces (``tracing``) and task helpers (``tasks``).

May import infra and engine only.
"""
