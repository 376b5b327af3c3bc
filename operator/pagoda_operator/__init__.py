"""Pagoda's control plane: a kopf operator for the InferenceService custom resource.

Modules, one concept each (pure ones first; only handlers.py, kube.py, leader.py, webhook.py and
cli.py touch the network):

- ``spec``: typed view of an InferenceService spec, defaults and the cross-field rules the schema
  cannot express.
- ``placement``: NodeTopology reading, NVLink cliques, node labels and affinity.
- ``builders``: spec + observed world -> desired ConfigMap, Service and Deployment.
- ``status``: observed Deployment and pods -> conditions and the rest of the status.
- ``autoscaler``: the proportional rule with tolerance, bounds and stabilisation windows.
- ``admission``: the admission policy, which parts of a spec need more than writing an
  InferenceService.
- ``metrics_scrape``: reading the daemons' Prometheus ``/metrics``.
- ``telemetry``: the operator's own Prometheus metrics.
- ``kube``: the Kubernetes API calls, compare-before-patch.
- ``reconcile``: one pass over one InferenceService, gluing the above together.
- ``leader``: Lease-based leader election so that two replicas never act at once.
- ``handlers``: thin kopf handlers.
- ``webhook``: the validating admission webhook, served on every replica.
- ``cli``: ``main(argv)``, used by ``pagoda operator`` and ``python -m pagoda_operator``.

The operator never imports torch, and from ``pagoda_daemon`` only the standard-library modules
that declare the daemon's options and capabilities (``config``, ``options``, ``capabilities``),
so that it refuses at apply time exactly what the daemon would refuse at start.
"""

GROUP = "pagoda.dev"
VERSION = "v1alpha1"
PLURAL = "inferenceservices"
KIND = "InferenceService"
TOPOLOGY_PLURAL = "nodetopologies"

__all__ = ["GROUP", "KIND", "PLURAL", "TOPOLOGY_PLURAL", "VERSION"]
