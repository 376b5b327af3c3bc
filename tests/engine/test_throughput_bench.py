"""`benchmarks/throughput.py` modes on CPU: `--profile-prefill-len` (prompts arrive at a decoding
batch and the engine's TTFT for each is reported) and `--step-log` (the GPU runs are what they are
for; these check the modes)."""

from __future__ import annotations

import json

from benchmarks import throughput


def test_arrivals_at_a_running_batch_report_the_engines_ttft(tiny_models, capsys):
    rc = throughput.main([tiny_models["qwen3"], "--device", "cpu", "--dtype", "float32", "--num-seqs", "3",
                          "--max-input-len", "120", "--max-output-len", "400", "--max-model-len", "1024",
                          "--profile-steps", "4", "--profile-prefill-len", "50"])
    assert rc == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    assert result["prefill_len"] == 50 and result["batch"] == 3  # the decoding batch, arrivals finished
    ttft = result["engine_ttft_ms"]
    assert len(ttft) == 4 and ttft == sorted(ttft) and ttft[0] > 0
    assert result["cpu_ms_per_step_by_phase"]["pagoda.forward"] > 0


def test_the_word_level_tokenizer_gives_back_the_ids_of_decoded_prompts(tmp_path):
    import random

    from transformers import AutoTokenizer

    throughput.save_word_level_tokenizer(2048, str(tmp_path))
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    ids = [random.randrange(2, 2048) for _ in range(500)]  # "w1" is EOS: "w150" must stay one word
    text = tokenizer.decode(ids, clean_up_tokenization_spaces=False)
    assert tokenizer.encode(text, add_special_tokens=False) == ids


def test_the_step_log_accounts_for_every_step_and_token(tiny_models, tmp_path, capsys):
    log = tmp_path / "steps.jsonl"
    rc = throughput.main([tiny_models["qwen3"], "--device", "cpu", "--dtype", "float32", "--num-seqs", "6",
                          "--min-input-len", "40", "--max-input-len", "90", "--min-output-len", "3",
                          "--max-output-len", "9", "--max-model-len", "1024", "--max-num-batched-tokens", "64",
                          "--step-log", str(log)])
    assert rc == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    steps = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(steps) == result["steps"]
    assert [s["t"] for s in steps] == sorted(s["t"] for s in steps)
    for s in steps:  # the budget holds, and every scheduled token is a prompt chunk's or a decode row's
        assert s["tokens"] == s["prefill_tokens"] + s["decode_rows"] <= 64
        assert 0.0 <= s["kv_usage"] <= 1.0
    # every prompt token is computed once (no preemption at this size); each request's first
    # output comes with its last prompt chunk, every later one from a decode row
    assert sum(s["prefill_tokens"] for s in steps) == result["prompt_tokens"]
    assert sum(s["decode_rows"] for s in steps) == result["output_tokens_generated"] - result["num_seqs"]
    assert steps[0]["waiting"] > 0 and steps[-1]["waiting"] == 0
