"""kube.py's pure parts."""

from __future__ import annotations

import pytest

from pagoda_operator.kube import in_cluster_server, path


@pytest.mark.parametrize(
    "env, server",
    [
        ({"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}, "https://10.96.0.1:443"),
        ({"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "6443"}, "https://[fd00::1]:6443"),
        ({"KUBERNETES_SERVICE_HOST": "10.96.0.1"}, None),
        ({}, None),
    ],
)
def test_in_cluster_server_is_the_service_address_not_a_dns_name(env, server):
    assert in_cluster_server(env) == server


def test_event_path():
    assert path("Event", "ns") == "/api/v1/namespaces/ns/events"
