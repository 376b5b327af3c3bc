"""Telemetry: Prometheus metrics (`metrics`), OpenTelemetry request tracing (`tracing`),
KV-cache events over ZMQ (`kv_events`) and torch-profiler phase labels (`profiling`).

The modules are independent; import the one you need, so that, say, the metrics do
not pull in ZMQ. Only `profiling` imports torch (the engine process has it anyway).
"""
