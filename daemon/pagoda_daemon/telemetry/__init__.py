"""Telemetry: Prometheus metrics (`metrics`), OpenTelemetry request tracing (`tracing`) and
KV-cache events over ZMQ (`kv_events`).

The three modules are independent; import the one you need, so that, say, the metrics do
not pull in ZMQ. Nothing here imports torch.
"""
