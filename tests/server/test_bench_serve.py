"""`pagoda bench serve|sweep` against a real `pagoda serve` on loopback (a tiny random Llama on
CPU): every request streamed and counted, latencies summarized, a sweep plotted and resumed."""

from __future__ import annotations

import json
import math
import statistics

import httpx
import pytest

from pagoda_daemon.bench import datasets
from pagoda_daemon.bench.cli import main
from pagoda_daemon.bench.run import arrival_gaps
from tests.server.conftest import MODEL_NAME

VOCAB = "512"  # the tiny models' vocabulary


def _served(url: str) -> float:
    """Requests the server has finished (all reasons), from its own metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total{"))


def _common(*extra: str) -> list[str]:
    return ["--model", MODEL_NAME, "--vocab-size", VOCAB, "--no-progress", *extra]


def test_one_point_streams_every_request_and_summarizes_latencies(server, tmp_path):
    out = tmp_path / "point.json"
    before = _served(server.url)
    rc = main(["serve", "--base-url", server.url, "--num-prompts", "6", "--input-len", "24", "--output-len", "5",
               "--range-ratio", "0.5", "--max-concurrency", "3", "--goodput", "ttft:600000", "--result-file", str(out),
               *_common()])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 6 and result["failed"] == 0
    assert _served(server.url) - before == 6
    expected = sum(r.output_len for r in datasets.random_requests(6, 24, 5, 512, range_ratio=0.5, seed=0))
    assert result["output_tokens"] == expected  # ignore_eos: every asked token came back
    ttft, e2el = result["ttft_ms"], result["e2el_ms"]
    assert 0 < ttft["p50"] <= ttft["p90"] <= ttft["p99"] and ttft["p99"] <= e2el["p99"]
    assert result["tpot_ms"]["mean"] > 0 and result["itl_ms"]["p50"] is not None
    assert result["goodput"] == pytest.approx(result["request_throughput"], rel=1e-3)  # a lenient SLO: all meet it
    assert result["config"]["request_rate"] == "inf" and "api_key" not in result["config"]
    assert result["client_cpu_s"] > 0
    # the server's own view of the same point: its histograms counted exactly these requests
    server = result["server_metrics"]
    assert server["time_to_first_token"]["count"] == 6 and server["request_queue_time"]["count"] == 6
    assert 0 < server["time_to_first_token"]["mean_ms"] <= ttft["mean"]
    assert server["request_queue_time"]["mean_ms"] <= server["time_to_first_token"]["mean_ms"]
    # the time before the server's arrival stamp (body, parse, checks) is counted too
    assert server["request_admission"]["count"] == 6
    assert 0 < server["request_admission"]["mean_ms"] + server["time_to_first_token"]["mean_ms"] <= ttft["mean"]


def test_a_tight_slo_counts_no_goodput_and_refused_requests_are_failures(server, tmp_path):
    out = tmp_path / "point.json"
    # 600 prompt tokens do not fit the server's max_model_len of 512: every request gets a 400
    rc = main(["serve", "--base-url", server.url, "--num-prompts", "2", "--input-len", "600", "--output-len", "4",
               "--result-file", str(out), *_common()])
    result = json.loads(out.read_text())
    assert rc == 1 and result["completed"] == 0 and result["failed"] == 2
    assert all(e.startswith("RuntimeError: HTTP 400") for e in result["errors"]), result["errors"]
    main(["serve", "--base-url", server.url, "--num-prompts", "3", "--input-len", "8", "--output-len", "3",
          "--goodput", "ttft:0.001", "--result-file", str(out), *_common()])
    result = json.loads(out.read_text())
    assert result["completed"] == 3 and result["goodput"] == 0


def test_multi_turn_conversations_run_on_the_chat_endpoint(server, tmp_path):
    out = tmp_path / "chat.json"
    rc = main(["serve", "--base-url", server.url, "--endpoint", "chat", "--dataset", "multi-turn", "--turns", "3",
               "--num-prompts", "2", "--input-len", "12", "--output-len", "4", "--result-file", str(out),
               *_common()])
    result = json.loads(out.read_text())
    assert rc == 0 and result["completed"] == 6 and result["failed"] == 0, result["errors"]
    assert result["output_tokens"] == 24


def test_token_id_conversations_reread_their_history_on_the_completions_endpoint(server, tmp_path):
    out = tmp_path / "conv.json"
    rc = main(["serve", "--base-url", server.url, "--dataset", "multi-turn", "--turns", "3", "--prefix-len", "40",
               "--document-len", "20", "--input-len", "8", "--num-prompts", "2", "--output-len", "4",
               "--max-concurrency", "2", "--result-file", str(out), *_common()])
    result = json.loads(out.read_text())
    assert rc == 0 and result["completed"] == 6 and result["failed"] == 0, result["errors"]
    # turn t: the 40-token context, the conversation's 20-token document, t turns of 8 and t - 1 answers of 4
    assert result["prompt_tokens"] == 2 * sum(40 + 20 + 8 * t + 4 * (t - 1) for t in (1, 2, 3))
    conv = datasets.conversation_requests(1, 3, 40, 8, 4, 4, 512, seed=0)[0]
    assert [len(p) for p in conv.turns] == [48, 60, 72]
    assert conv.turns[1][:48] == conv.turns[0] and conv.turns[2][:60] == conv.turns[1]  # each extends the last
    # each conversation's own document after the shared context: shared by its turns, by no other conversation
    first, second = datasets.conversation_requests(2, 2, 40, 8, 4, 4, 512, document_len=30, seed=0)
    assert [len(p) for p in first.turns] == [78, 90] and first.turns[1][:78] == first.turns[0]
    assert first.turns[0][:40] == second.turns[0][:40] and first.turns[0][40:70] != second.turns[0][40:70]


def test_sweep_plots_and_resumes_only_the_unfinished_points(server, tmp_path):
    args = ["sweep", "--server", f"pagoda={server.url}", "--workload-var", "max_concurrency", "--values", "1,3",
            "--experiment-name", "conc", "--output-dir", str(tmp_path), "--num-prompts", "3", "--input-len", "16",
            "--output-len", "3", *_common()]
    assert main(args) == 0
    root = tmp_path / "conc"
    points = sorted(root.glob("pagoda/*/iter-0.json"))
    assert [p.parent.name for p in points] == ["max_concurrency=1", "max_concurrency=3"]
    # new prompts for every point (none served from the prefix cache an earlier point filled)
    assert [json.loads(p.read_text())["config"]["seed"] for p in points] == [0, 1]
    for ext in ("png", "svg"):
        assert (root / f"throughput_vs_ttft.{ext}").stat().st_size > 1000
    assert main(args) == 2  # the points exist: no silent overwrite without --resume

    points[1].unlink()  # as if the sweep had been interrupted before its last point
    before = _served(server.url)
    assert main([*args, "--resume"]) == 0
    assert _served(server.url) - before == 3  # only the missing point's requests were sent
    assert json.loads(points[1].read_text())["completed"] == 3


@pytest.mark.parametrize("argv", [
    ["sweep", "--server", "no-url", "--workload-var", "request_rate", "--values", "1", "--experiment-name", "x"],
    ["sweep", "--server", "a=http://127.0.0.1:1", "--workload-var", "request_rate", "--values=-1,2",
     "--experiment-name", "x"],
    ["sweep", "--server", "a=http://127.0.0.1:1", "--workload-var", "request_rate", "--values", "1",
     "--experiment-name", "../up"],
    ["serve", "--base-url", "http://127.0.0.1:1", "--dataset", "jsonl"],
    ["serve", "--base-url", "http://127.0.0.1:1", "--document-len", "5"],  # random prompts have no documents
    ["sweep", "--server", "a=http://127.0.0.1:1", "--workload-var", "document_len", "--values", "10,20",
     "--experiment-name", "x", "--dataset", "multi-turn", "--endpoint", "chat"],
])
def test_bad_arguments_exit_2_with_a_message(argv, tmp_path, capsys):
    rc = main([*argv, *(["--output-dir", str(tmp_path)] if argv[0] == "sweep" else []), "--model", "m",
               "--vocab-size", VOCAB, "--no-progress"])
    assert rc == 2 and "pagoda bench:" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--request-rate=0", "--request-rate=nan", "--range-ratio=1", "--num-prompts=0",
                                  "--goodput=ttft:-1", "--goodput=latency:5",
                                  "--document-len=-1", "--document-len=x"])
def test_out_of_bounds_flags_are_refused_by_the_parser(flag, capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--base-url", "http://127.0.0.1:1", flag, *_common()])
    assert e.value.code == 2


def test_jsonl_prompts_are_checked_line_by_line(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "hello"}\n\n{"prompt": [5, 6, 7], "output_len": 9}\n')
    requests = datasets.jsonl_requests(good, 5, 4, seed=1)
    assert len(requests) == 5 and {r.output_len for r in requests} == {4, 9}
    for bad in ('{"prompt": ""}', '{"prompt": [1, -2]}', '{"prompt": "x", "output_len": 0}', '[1, 2]'):
        path = tmp_path / "bad.jsonl"
        path.write_text(bad + "\n")
        with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
            datasets.jsonl_requests(path, 1, 4)


def test_arrivals_are_poisson_at_burstiness_one_and_burstier_below():
    rate = 20.0
    poisson = arrival_gaps(20000, rate, 1.0, seed=3)
    assert statistics.fmean(poisson) == pytest.approx(1 / rate, rel=0.03)
    assert statistics.stdev(poisson) == pytest.approx(1 / rate, rel=0.05)  # exponential: sd = mean
    bursty = arrival_gaps(20000, rate, 0.25, seed=3)
    assert statistics.fmean(bursty) == pytest.approx(1 / rate, rel=0.05)
    assert statistics.stdev(bursty) > 1.8 * statistics.stdev(poisson)  # gamma(k): sd = mean / sqrt(k)
    assert arrival_gaps(4, math.inf, 1.0, seed=0) == [0.0] * 4


def test_shared_prefix_requests_share_their_prefixes():
    requests = datasets.shared_prefix_requests(6, 2, 10, 5, 3, 512, seed=0)
    assert requests[0].prompt[:10] == requests[2].prompt[:10] != requests[1].prompt[:10]
    assert all(len(r.prompt) == 15 and min(r.prompt) >= datasets.FIRST_ORDINARY_TOKEN for r in requests)


def test_server_histograms_are_differenced_and_their_quantiles_bounded():
    from pagoda_daemon.bench import server_metrics

    def exposition(counts: list[int], total: float) -> str:  # buckets 0.01, 0.1, 1, +Inf
        cumulative = [sum(counts[: i + 1]) for i in range(4)]
        lines = ["# TYPE vllm:time_to_first_token_seconds histogram"]
        for bound, c in zip(("0.01", "0.1", "1.0", "+Inf"), cumulative):
            for model in ("a", "b"):  # summed over labels
                lines.append(f'vllm:time_to_first_token_seconds_bucket{{le="{bound}",model_name="{model}"}} {c / 2}')
        lines += [f'vllm:time_to_first_token_seconds_count{{model_name="a"}} {cumulative[-1]}',
                  f'vllm:time_to_first_token_seconds_sum{{model_name="a"}} {total}',
                  "# TYPE vllm:other_seconds histogram", 'vllm:other_seconds_count 5', 'vllm:other_seconds_sum 1']
        return "\n".join(lines) + "\n"

    before = server_metrics.parse(exposition([2, 0, 0, 0], 0.01))
    after = server_metrics.parse(exposition([2, 10, 10, 0], 5.51))
    got = server_metrics.difference(before, after)
    assert list(got) == ["time_to_first_token"]  # only the known histograms
    ttft = got["time_to_first_token"]
    assert ttft["count"] == 20 and ttft["mean_ms"] == pytest.approx(275.0)
    assert ttft["p50_le_ms"] == pytest.approx(100.0)  # rank 10 of 20 lies in the bucket up to 0.1 s
    assert ttft["p90_le_ms"] == pytest.approx(1000.0)
    assert server_metrics.difference(None, after) is None
    assert server_metrics.quantile_bound(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None
    assert server_metrics.quantile_bound(0.99, [(0.1, 1.0), (float("inf"), 3.0)]) is None  # past the last bound
    assert server_metrics.quantile_bound(0.3, [(0.1, 1.0), (float("inf"), 3.0)]) == 0.1
    assert server_metrics.scrape("http://127.0.0.1:1") is None  # nothing listening: no entry, no error


def test_throughput_runs_the_same_requests_through_the_offline_llm(tiny_models, tmp_path):
    out = tmp_path / "offline.json"
    rc = main(["throughput", tiny_models["llama"], "--device", "cpu", "--dtype", "float32", "--max-model-len", "512",
               "--num-prompts", "5", "--input-len", "30", "--output-len", "6", "--range-ratio", "0.5",
               "--vocab-size", VOCAB, "--result-file", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    asked = datasets.random_requests(5, 30, 6, 512, range_ratio=0.5, seed=0)  # what bench serve sends
    assert result["num_requests"] == 5
    assert result["prompt_tokens"] == sum(len(r.prompt) for r in asked)
    assert result["output_tokens"] == sum(r.output_len for r in asked)  # ignore_eos: every asked token
    assert result["output_throughput"] == pytest.approx(result["output_tokens"] / result["duration_s"])


def test_throughput_refuses_conversations(tiny_models, capsys):
    rc = main(["throughput", tiny_models["llama"], "--device", "cpu", "--dataset", "multi-turn", "--vocab-size", VOCAB])
    assert rc == 2 and "bench serve" in capsys.readouterr().err


def test_prompts_decoded_to_text_go_through_the_servers_tokenizer(server, tiny_models, tmp_path):
    out = tmp_path / "text.json"
    rc = main(["serve", "--base-url", server.url, "--num-prompts", "4", "--input-len", "20", "--output-len", "3",
               "--decode-prompts-with", tiny_models["llama"], "--result-file", str(out), *_common()])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 4 and result["failed"] == 0
    assert result["prompt_tokens"] > 0  # counted by the server from the text it tokenized
    texts = datasets.as_text(datasets.random_requests(4, 20, 3, 512, seed=0), lambda ids: " ".join(map(str, ids)))
    assert all(isinstance(r.prompt, str) and len(r.prompt.split()) == 20 for r in texts)


def test_a_tokenizer_that_cannot_load_exits_2(tmp_path, capsys):
    rc = main(["serve", "--base-url", "http://127.0.0.1:1", "--decode-prompts-with", str(tmp_path / "none"),
               *_common()])
    assert rc == 2 and "--decode-prompts-with" in capsys.readouterr().err


def test_the_embeddings_endpoint(tmp_path):
    """--endpoint embeddings against a pooling server: one input a request, every reply one vector,
    the end-to-end latency and input tokens/s summarized, a sweep plotted on those axes."""
    from pagoda_daemon.models.tiny import build_tiny_embedding_model
    from tests.server.conftest import running

    path = str(build_tiny_embedding_model("qwen3", tmp_path / "embed", seed=31))
    with running(path, "--max-model-len", "256", log_dir=tmp_path, served_name="embed") as srv:
        before = _served(srv.url)
        out = tmp_path / "point.json"
        common = ["--model", "embed", "--endpoint", "embeddings", "--vocab-size", VOCAB, "--no-progress",
                  "--input-len", "40", "--range-ratio", "0.5"]
        assert main(["serve", "--base-url", srv.url, "--num-prompts", "12", "--max-concurrency", "4",
                     "--result-file", str(out), *common]) == 0
        result = json.loads(out.read_text())
        assert result["completed"] == 12 and result["failed"] == 0 and _served(srv.url) - before == 12
        sent = datasets.random_requests(12, 40, 128, 512, range_ratio=0.5, seed=0)
        assert result["prompt_tokens"] == sum(len(r.prompt) for r in sent) and result["output_tokens"] == 0
        assert 0 < result["e2el_ms"]["p50"] <= result["e2el_ms"]["p99"] and result["ttft_ms"]["p50"] is None
        assert result["total_token_throughput"] > 0
        assert main(["sweep", "--server", f"pagoda={srv.url}", "--workload-var", "max_concurrency", "--values", "1,4",
                     "--experiment-name", "embed", "--output-dir", str(tmp_path / "sweep"), "--num-prompts", "6",
                     *common]) == 0
        assert (tmp_path / "sweep" / "embed" / "throughput_vs_latency.png").stat().st_size > 0
    assert main(["serve", "--base-url", "http://127.0.0.1:9", "--dataset", "multi-turn", *common]) == 2


def test_the_rerank_endpoint(tmp_path):
    """--endpoint rerank against a cross-encoder server: a query and its documents a request (random
    token ids sent as text), every document ranked in the reply, the server's token count and the
    end-to-end latency summarized, a sweep over documents per query plotted on those axes; what
    the endpoint cannot send is refused before a request leaves."""
    from pagoda_daemon.models.tiny import build_tiny_encoder
    from tests.server.conftest import running

    path = str(build_tiny_encoder("bert", tmp_path / "reranker", seed=43, num_labels=1))
    vocab = str(json.loads((tmp_path / "reranker" / "config.json").read_text())["vocab_size"])
    common = ["--model", "rerank", "--endpoint", "rerank", "--vocab-size", vocab, "--no-progress",
              "--decode-prompts-with", path, "--query-len", "6", "--input-len", "30", "--range-ratio", "0.5"]
    with running(path, "--max-model-len", "128", log_dir=tmp_path, served_name="rerank") as srv:
        before = _served(srv.url)
        out = tmp_path / "point.json"
        assert main(["serve", "--base-url", srv.url, "--num-prompts", "5", "--documents-per-query", "7",
                     "--max-concurrency", "2", "--result-file", str(out), *common]) == 0
        result = json.loads(out.read_text())
        assert result["completed"] == 5 and result["failed"] == 0
        assert _served(srv.url) - before == 5 * 7  # one engine request per pair
        sent = datasets.rerank_requests(5, 7, 6, 30, int(vocab), range_ratio=0.5, seed=0)
        assert all(len(r.documents) == 7 for r in sent)
        # every pair holds the query, the document and the pair's special tokens, as the server counts them
        assert result["prompt_tokens"] >= sum(7 * len(r.prompt) + sum(map(len, r.documents)) for r in sent) * 0.5
        assert result["output_tokens"] == 0 and result["ttft_ms"]["p50"] is None
        assert 0 < result["e2el_ms"]["p50"] <= result["e2el_ms"]["p99"] and result["total_token_throughput"] > 0
        assert main(["sweep", "--server", f"pagoda={srv.url}", "--workload-var", "documents_per_query",
                     "--values", "2,6", "--experiment-name", "rerank", "--output-dir", str(tmp_path / "sweep"),
                     "--num-prompts", "3", *common]) == 0
        points = [json.loads(p.read_text()) for p in (tmp_path / "sweep" / "rerank").rglob("iter-*.json")]
        assert sorted(p["completed"] for p in points) == [3, 3] and len({p["prompt_tokens"] for p in points}) == 2
        assert (tmp_path / "sweep" / "rerank" / "throughput_vs_latency.svg").stat().st_size > 0
    without_text = [a for a in common if a not in ("--decode-prompts-with", path)]
    for argv in (without_text, [*common, "--dataset", "shared-prefix"], [*common, "--dataset", "multi-turn"]):
        assert main(["serve", "--base-url", "http://127.0.0.1:9", *argv]) == 2
