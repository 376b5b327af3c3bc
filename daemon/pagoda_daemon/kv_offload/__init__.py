"""KV offload: full KV blocks kept beyond the GPU's prefix cache, in host memory and on disk.

The shape of vLLM v1's KV connectors, cut down: a scheduler half (``connector.OffloadConnector``)
that knows which block hashes each tier holds and plans every copy, and a worker half
(``connector.OffloadWorker``) that performs them on each rank. ``cpu.py`` and ``disk.py`` are
the tiers, ``tiered.py`` puts them in order (host memory, then disk). docs/kv-offload.md.
"""
