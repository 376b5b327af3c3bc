"""The ecosystem's own clients, unchanged, against `pagoda serve` on a tiny model on loopback:
lm-eval (loglikelihood, rolling loglikelihood and generation tasks over completions, and a chat
task through the chat template), guidellm (constant-rate and sweep, streaming), aiperf
(streaming with per-chunk usage and the server's token counts) and inference-perf (its vLLM
client, streaming, over completions with the chat template applied and over chat).

Each tool is installed from the package registry at the versions pinned in e2e/clients/ (one
virtual environment per tool, cached outside the clone: e2e/clients/ensure-clients.sh). Data is
local: lm-eval reads task files written here, guidellm and aiperf make synthetic prompts with
the tiny model's tokenizer; nothing comes from a model hub. Every check reads the tool's own
report (guidellm exits 0 even when every request failed).

inference-perf publishes only for Python 3.12 and newer: ensure-clients.sh builds its environment
with a Python 3.12 interpreter (pyenv's on these machines).
"""

from __future__ import annotations

import functools
import json
import math
import os
import random
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENSURE = ROOT / "e2e" / "clients" / "ensure-clients.sh"
MODEL_NAME = "tiny"
WORDS = ["paged", "attention", "stores", "the", "key", "and", "value", "cache", "in", "fixed", "size", "blocks", "so", "memory", "is", "never", "fragmented", "and", "prefixes", "can", "be", "shared", "between", "requests"]


def _env_flag(name: str) -> bool | None:
    value = os.environ.get(name)
    return None if value is None else value.strip().lower() not in ("", "0", "false", "no")


@pytest.fixture(scope="module")
def clients(pytestconfig) -> dict[str, Path]:
    """Each tool's environment, installed when allowed (PAGODA_E2E_BUILD=1, or in CI), else
    the tests skip when one is missing."""
    build = _env_flag("PAGODA_E2E_BUILD")
    if build is None:
        build = bool(_env_flag("CI"))
    if build:
        capture = pytestconfig.pluginmanager.getplugin("capturemanager")
        with capture.global_and_fixture_disabled():
            rc = subprocess.run([str(ENSURE)], check=False).returncode
        if rc != 0:
            pytest.fail(f"{ENSURE} failed with exit code {rc}", pytrace=False)
    elif subprocess.run([str(ENSURE), "--check"], capture_output=True, check=False).returncode != 0:
        pytest.skip(f"client environments missing: run {ENSURE} once or set PAGODA_E2E_BUILD=1")
    return {t: Path(subprocess.run([str(ENSURE), "--print-dir", t], capture_output=True, text=True,
                                   check=True).stdout.strip())
            for t in ("lm-eval", "guidellm", "aiperf", "inference-perf")}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from pagoda_daemon.models.tiny import build_tiny_model

    return build_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"), seed=random.randrange(2**31))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    from tests.server.conftest import ServerProcess

    srv = ServerProcess(str(model_dir), "--max-model-len", "512", log_dir=tmp_path_factory.mktemp("logs"),
                        served_name=MODEL_NAME)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def run_tool(argv: list[str], cwd: Path, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false", "NO_COLOR": "1", **env})
    assert proc.returncode == 0, f"{argv[0]} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def assert_served_clean(server) -> None:
    """The engine idle with every block back, and no server error in its log."""
    engine = server.wait_idle(timeout=30)
    assert engine["in_flight"] == 0, engine
    log = server.log_path.read_text()
    assert "Traceback" not in log and "internal error" not in log, log[-3000:]


# ---- lm-eval ---------------------------------------------------------------------------------

def write_tasks(folder: Path) -> None:
    """Three tasks over local JSONL files: multiple choice (loglikelihood), rolling
    loglikelihood (perplexity) and generate_until."""
    rng = random.Random()
    sentence = lambda k: " ".join(rng.choices(WORDS, k=k))  # noqa: E731
    rows = {
        "choice": [{"question": sentence(6), "choices": [" " + w for w in rng.sample(WORDS, 3)], "answer": i % 3}
                   for i in range(8)],
        "text": [{"text": sentence(30 + 25 * i)} for i in range(3)],
        "gen": [{"question": sentence(5), "answer": "blocks"} for _ in range(4)],
    }
    for name, items in rows.items():
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in items))
    common = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path}\ntest_split: test\n"
    tasks = {
        "pagoda_choice": ("choice", "output_type: multiple_choice\ndoc_to_text: \"{{question}}\"\n"
                                    "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\n"
                                    "metric_list:\n  - metric: acc\n"),
        "pagoda_rolling": ("text", "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\n"
                                   "doc_to_target: \"{{text}}\"\nmetric_list:\n  - metric: word_perplexity\n"
                                   "  - metric: bits_per_byte\n"),
        "pagoda_generate": ("gen", "output_type: generate_until\ndoc_to_text: \"{{question}}\"\n"
                                   "doc_to_target: \"{{answer}}\"\ngeneration_kwargs:\n  until: [\"\\n\"]\n"
                                   "  max_gen_toks: 8\n  do_sample: false\nmetric_list:\n  - metric: exact_match\n"),
    }
    for task, (data, body) in tasks.items():
        (folder / f"{task}.yaml").write_text(f"task: {task}\n" + common.format(path=folder / f"{data}.jsonl") + body)


def lm_eval(clients, folder: Path, model: str, url: str, model_dir: Path, tasks: str, *extra: str) -> dict:
    out = folder / f"out-{model}"
    run_tool([str(clients["lm-eval"] / "bin" / "lm_eval"), "--model", model, "--model_args",
              f"model={MODEL_NAME},base_url={url},tokenizer={model_dir},tokenizer_backend=huggingface,"
              "num_concurrent=4,max_retries=1",
              "--tasks", tasks, "--include_path", str(folder), "--output_path", str(out), "--log_samples", *extra],
             cwd=folder, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    samples = {f.name.split("_2")[0].removeprefix("samples_"): [json.loads(line) for line in f.open()]
               for f in out.rglob("samples_*.jsonl")}
    return {"results": results["results"], "samples": samples}


@functools.cache
def hf_model(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir), AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def hf_loglikelihood(model_dir: Path, context: str, continuation: str) -> float:
    """What lm-eval's loglikelihood means, computed by transformers on the same weights: the
    continuation's tokens (split as lm-eval splits them) scored after the context."""
    import torch

    tok, model = hf_model(model_dir)
    n_space = len(context) - len(context.rstrip())
    if n_space:  # lm-eval moves the context's trailing whitespace onto the continuation
        context, continuation = context[:-n_space], context[-n_space:] + continuation
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    ctx = tok(context, add_special_tokens=False).input_ids
    cont = whole[len(ctx):]
    with torch.no_grad():
        logits = model(torch.tensor([whole])).logits[0].float().log_softmax(-1)
    return sum(logits[len(ctx) - 1 + i, t].item() for i, t in enumerate(cont))


def test_lm_eval_completions_tasks_and_loglikelihood_parity(server, clients, model_dir, tmp_path):
    write_tasks(tmp_path)
    run = lm_eval(clients, tmp_path, "local-completions", server.url + "/v1/completions", model_dir,
                  "pagoda_choice,pagoda_rolling,pagoda_generate")
    results, samples = run["results"], run["samples"]
    assert set(results) == {"pagoda_choice", "pagoda_rolling", "pagoda_generate"}, results
    assert 0.0 <= results["pagoda_choice"]["acc,none"] <= 1.0
    assert math.isfinite(results["pagoda_rolling"]["word_perplexity,none"])
    assert results["pagoda_rolling"]["bits_per_byte,none"] > 0
    assert len(samples["pagoda_choice"]) == 8 and len(samples["pagoda_rolling"]) == 3
    assert len(samples["pagoda_generate"]) == 4
    # echo logprobs are a correctness feature: each choice's loglikelihood equals transformers'
    for sample in samples["pagoda_choice"]:
        for args, resp in zip(sample["arguments"].values(), sample["resps"]):
            got = float(resp[0][0])
            want = hf_loglikelihood(model_dir, args["arg_0"], args["arg_1"])
            assert got == pytest.approx(want, abs=1e-4), (args, got, want)
    assert_served_clean(server)


def test_lm_eval_chat_completions_with_the_chat_template(server, clients, model_dir, tmp_path):
    write_tasks(tmp_path)
    run = lm_eval(clients, tmp_path, "local-chat-completions", server.url + "/v1/chat/completions", model_dir,
                  "pagoda_generate", "--apply_chat_template")
    assert "exact_match,none" in run["results"]["pagoda_generate"]
    generated = [s["resps"][0][0] for s in run["samples"]["pagoda_generate"]]
    assert len(generated) == 4 and all(isinstance(g, str) for g in generated)
    assert_served_clean(server)


# ---- guidellm --------------------------------------------------------------------------------

def guidellm(clients, server, model_dir, tmp_path, profile: str, requests: int) -> list[dict]:
    report = tmp_path / f"guidellm-{profile.split(',')[0].split('=')[1]}.json"
    run_tool([str(clients["guidellm"] / "bin" / "guidellm"), "run",
              "--backend", f"kind=openai_http,target={server.url},model={MODEL_NAME}",
              "--profile", profile, "--constraint", f"kind=max_requests,count={requests}",
              "--data", "kind=synthetic_text,prompt_tokens=24,output_tokens=8",
              "--tokenizer", f"kind=hf_auto,model={model_dir}",
              "--output", f"kind=json,path={report}", "--disable-console-interactive"], cwd=tmp_path)
    return json.loads(report.read_text())["benchmarks"]


@pytest.mark.parametrize("profile", ["kind=constant,rate=8", "kind=sweep,sweep_size=3"])
def test_guidellm_streaming_runs_every_request(server, clients, model_dir, tmp_path, profile):
    benchmarks = guidellm(clients, server, model_dir, tmp_path, profile, requests=16)
    assert len(benchmarks) >= (3 if "sweep" in profile else 1)
    for b in benchmarks:
        m = b["metrics"]
        totals = m["request_totals"]
        assert totals["errored"] == 0 and totals["incomplete"] == 0 and totals["successful"] == totals["total"] > 0
        assert m["time_to_first_token_ms"]["successful"]["mean"] > 0
        assert m["inter_token_latency_ms"]["successful"]["mean"] > 0
        assert m["output_token_count"]["successful"]["mean"] > 0
    assert_served_clean(server)


# ---- aiperf ----------------------------------------------------------------------------------

# aiperf 0.13 asks for usage on every chunk on the chat endpoint only
@pytest.mark.parametrize(("endpoint", "per_chunk"), [("chat", ["--per-chunk-usage"]), ("completions", [])])
def test_aiperf_streaming_with_server_token_counts(server, clients, model_dir, tmp_path, endpoint, per_chunk):
    out = tmp_path / "aiperf"
    # HF_HUB_OFFLINE stays unset: with it, aiperf 0.13 reads a tokenizer path as a hub repo id
    run_tool([str(clients["aiperf"] / "bin" / "aiperf"), "profile", "--model", MODEL_NAME, "--url", server.url,
              "--endpoint-type", endpoint, "--streaming", *per_chunk, "--use-server-token-count",
              "--tokenizer", str(model_dir), "--request-count", "24", "--concurrency", "4",
              "--synthetic-input-tokens-mean", "24", "--output-tokens-mean", "8",
              "--extra-inputs", "ignore_eos:true",
              "--artifact-dir", str(out), "--ui-type", "none"], cwd=tmp_path)
    report = json.loads((out / "profile_export_aiperf.json").read_text())
    assert report["request_count"]["avg"] == 24, report["request_count"]
    assert not report.get("error_summary"), report["error_summary"]
    assert report["time_to_first_token"]["avg"] > 0 and report["inter_token_latency"]["avg"] > 0
    # the server's own counts (usage on every chunk): 8 tokens per request, as asked with ignore_eos
    assert report["output_sequence_length"]["avg"] == 8, report["output_sequence_length"]
    assert_served_clean(server)



# ---- inference-perf ----------------------------------------------------------------------------

INFERENCE_PERF_RUNS = {
    # the random generator's prompts wrapped in the model's chat template and sent to completions
    # with add_special_tokens false, input lengths counting the whole templated prompt
    "completion-chat-template": {
        "api": {"type": "completion", "streaming": True},
        "data": {"type": "random", "use_chat_template": True,
                 "input_distribution": {"min": 40, "max": 90, "mean": 60, "total_count": 24},
                 "output_distribution": {"min": 8, "max": 24, "mean": 16, "total_count": 24}},
    },
    "chat": {"api": {"type": "chat", "streaming": True}, "data": {"type": "mock"}},
}


@pytest.mark.parametrize("run", INFERENCE_PERF_RUNS)
def test_inference_perf_vllm_client_serves_every_request(server, clients, model_dir, tmp_path, run):
    """inference-perf's vLLM client at 4 requests/s for 6 s, streaming: every request a success in
    its own report, no error in its report validation, the server's usage counts used (no client
    fallback). With the chat template applied client-side (sent with add_special_tokens false),
    each prompt's count by the server equals the client's, so the report's input lengths are
    the server's. (The tiny tokenizer adds no BOS, so this does not tell whether the field is
    honoured; tests/server/test_vllm_compat.py takes the field.)"""
    out = tmp_path / "out"
    config = {**INFERENCE_PERF_RUNS[run],
              "load": {"type": "constant", "stages": [{"rate": 4, "duration": 6}]},
              "server": {"type": "vllm", "model_name": MODEL_NAME, "base_url": server.url, "ignore_eos": True},
              "tokenizer": {"pretrained_model_name_or_path": str(model_dir)},
              "report": {"request_lifecycle": {"summary": True, "per_stage": True, "per_request": True}},
              "storage": {"local_storage": {"path": str(out)}}}
    (tmp_path / "config.yml").write_text(json.dumps(config))  # YAML reads JSON
    run_tool([str(clients["inference-perf"] / "bin" / "inference-perf"), "-c", "config.yml"], cwd=tmp_path,
             HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")

    summary = json.loads((out / "summary_lifecycle_metrics.json").read_text())
    ok = summary["successes"]
    assert summary["failures"]["count"] == 0, summary["failures"]
    # Every request the client sent succeeded. How many it sends of the 24 the stage asks for
    # depends on its own timing: 18 on a busy 2-core CI machine (2026-11-29), hence half as the bound.
    assert ok["count"] == summary["load_summary"]["count"] >= 12, (ok["count"], summary["load_summary"]["count"])
    assert ok["client_fallback_requests"] == {"prompt": 0, "output": 0}, ok["client_fallback_requests"]
    assert ok["latency"]["time_to_first_token"]["mean"] > 0 and ok["latency"]["inter_token_latency"]["mean"] > 0
    validation = json.loads((out / "validation.json").read_text())
    assert not validation["global"]["errors"], validation["global"]
    assert not any(r.get("errors") for r in validation["reports"].values()), validation["reports"]

    records = json.loads((out / "per_request_lifecycle_metrics.json").read_text())
    sent = [json.loads(r["request"]) for r in records]
    assert len(sent) == ok["count"]
    assert ok["output_tokens"]["total"] == sum(r["max_tokens"] for r in sent)  # ignore_eos: every token asked for
    if run == "chat":
        assert all(r["messages"] and "prompt" not in r for r in sent)
    else:
        assert all(r["add_special_tokens"] is False and r["prompt"].startswith("<|user|>") for r in sent)
        # the client counts the templated prompt without special tokens added, as the server must
        counts = [(r["info"]["input_tokens"], r["info"]["response_metrics"]["server_usage"]["prompt_tokens"])
                  for r in records]
        assert all(client == served for client, served in counts), counts
    assert_served_clean(server)
