"""The operator's NetworkPolicy flags: what the chart passes parses, anything else is a usage error."""

from __future__ import annotations

import pytest

from pagoda_operator.cli import main, parser


def test_network_policy_flags_parse_peers():
    args = parser().parse_args(
        [
            "--network-policy",
            '--network-policy-http-from={"namespaceSelector": {"matchLabels": {"team": "a"}}}',
            '--network-policy-http-from={"ipBlock": {"cidr": "10.0.0.0/8"}}',
        ]
    )
    assert args.network_policy is True
    assert args.network_policy_http_from == [
        {"namespaceSelector": {"matchLabels": {"team": "a"}}},
        {"ipBlock": {"cidr": "10.0.0.0/8"}},
    ]
    defaults = parser().parse_args([])
    assert defaults.network_policy is False and defaults.network_policy_http_from == []


@pytest.mark.parametrize("peer", ["not json", "[]", "{}", '{"namespaceSelector": {}, "ports": [80]}'])
def test_a_peer_that_is_not_a_network_policy_peer_is_a_usage_error(peer, capsys):
    assert main([f"--network-policy-http-from={peer}"]) == 2
    assert "--network-policy-http-from" in capsys.readouterr().err
