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


@pytest.mark.parametrize("flag, value", [
    ("--workers", "0"), ("--workers", "-3"), ("--workers", "1e9"), ("--workers", "two"),
    ("--interval", "-1"), ("--interval", "nan"), ("--interval", "inf"), ("--scrape-timeout", "0"),
    ("--lease-duration", "1"), ("--lease-duration", "99999"), ("--lease-renew", "0"),
    ("--lease-grace", "nan"), ("--lease-grace", "-5"), ("--lease-grace", "1e12"),
    ("--lws-discovery-interval", "0"), ("--lws-discovery-interval", "nan"),
])
def test_numbers_out_of_bounds_are_usage_errors(flag, value, capsys):
    assert main([f"{flag}={value}"]) == 2
    assert flag in capsys.readouterr().err


def test_numbers_at_their_bounds_parse():
    args = parser().parse_args(["--workers=256", "--interval=0.1", "--lease-duration=2", "--lease-grace=86400"])
    assert (args.workers, args.interval, args.lease_duration, args.lease_grace) == (256, 0.1, 2, 86400.0)
    assert parser().parse_args([]).lease_grace == 60.0
    assert parser().parse_args([]).lws_discovery_interval == 60.0


def test_an_otlp_protocol_the_operator_does_not_speak_is_refused_at_start(monkeypatch, capsys):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "thrift")
    assert main([]) == 2
    assert "pagoda operator: tracing: OTEL_EXPORTER_OTLP_PROTOCOL 'thrift'" in capsys.readouterr().err


def test_model_config_endpoints_are_urls_or_none(capsys):
    assert parser().parse_args([]).model_config_endpoint is None  # the default Hub (cli.main)
    args = parser().parse_args(["--model-config-endpoint=https://hub.example/", "--model-config-endpoint=none"])
    assert args.model_config_endpoint == ["https://hub.example", "none"]
    for bad in ("ftp://hub.example", "https://user:pw@hub.example", "hub.example", ""):
        assert main([f"--model-config-endpoint={bad}"]) == 2
        assert "--model-config-endpoint" in capsys.readouterr().err
