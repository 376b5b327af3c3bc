"""`benchmarks/throughput.py --profile-prefill-len` on CPU: prompts arrive at a decoding batch and
the engine's TTFT for each is reported (the GPU run is what it is for; this checks the mode)."""

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
