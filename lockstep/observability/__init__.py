"""Operating Lockstep: Prometheus metrics (`metrics`), the gateway's `/metrics` (`asgi`) and the
scheduler's ops HTTP server (`ops_server`: `/metrics`, `/healthz`, `/livez`).

docs/operations.md says what each metric means, which alerts to set and how to size a cycle.
"""
