#!/usr/bin/env bash
# The API process at saturation, on a CPU: `pagoda serve` with a tiny random-weight model (the
# engine makes tokens faster than one API process can stream them to hundreds of clients), 400
# streamed requests at once from `pagoda bench serve`; per tree, the clients' TTFT and ITL beside
# the server's own TTFT (its histogram: when the API process had the first token). The gap
# between the two is time a token waited in the API process.
#
#   bash benchmarks/stream_saturation_cpu.sh [TREE ...]   # trees: copies of daemon/ (default: this one)
#
# Results: $OUT/stream-<label>-<round>.json (OUT defaults to .out/stream).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/.out/stream}; ROUNDS=${ROUNDS:-2}; PROMPTS=${PROMPTS:-400}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
M=$(mktemp -d)
trap 'rm -rf "$M"' EXIT
$PY - "$M" <<'PY'
import json, sys
from benchmarks.throughput import save_word_level_tokenizer
config = json.load(open("benchmarks/configs/qwen3-0.6b/config.json"))
config.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=2048, torch_dtype="float32")
json.dump(config, open(f"{sys.argv[1]}/config.json", "w"))
save_word_level_tokenizer(2048, sys.argv[1])
PY
trees=("$@"); [ ${#trees[@]} -eq 0 ] && trees=(.)
api_cpu() { awk '{print ($14 + $15) / 100}' "/proc/$1/stat"; }  # PID: the API process's CPU seconds (user + system)
for round in $(seq 1 "$ROUNDS"); do
  for tree in "${trees[@]}"; do  # interleaved, so that the machine's drift falls on every tree alike
    label=$(basename "$(cd "$tree" && pwd)"); port=$((18500 + RANDOM % 1000))
    PYTHONPATH=$tree/daemon:$tree/kernels:$PWD $PY -m pagoda_daemon serve "$M" --load-format dummy --device cpu \
      --dtype float32 --max-model-len 512 --port $port --served-model-name m --seed 0 > "$OUT/serve-$label.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 120); do curl -sf "localhost:$port/ready" >/dev/null && break; sleep 1; done
    before=$(api_cpu $pid)
    PYTHONPATH=$PWD/daemon:$PWD/kernels:$PWD $PY -m pagoda_daemon bench serve --base-url "http://127.0.0.1:$port" \
      --model m --vocab-size 2048 --num-prompts "$PROMPTS" --input-len 32 --output-len 256 --range-ratio 0.5 \
      --no-progress --result-file "$OUT/stream-$label-$round.json" > /dev/null
    spent=$(awk -v a="$(api_cpu $pid)" -v b="$before" 'BEGIN { print a - b }')
    kill -TERM $pid; wait $pid || true
    $PY - "$OUT/stream-$label-$round.json" "$label" "$spent" <<'PY'
import json, sys
path, label, api_cpu = sys.argv[1], sys.argv[2], float(sys.argv[3])
r = json.load(open(path)); s = r["server_metrics"]["time_to_first_token"]
r["api_process_cpu_s"] = api_cpu
json.dump(r, open(path, "w"))
print(f"{label}: {r['output_throughput']:.0f} output tok/s, client TTFT mean {r['ttft_ms']['mean']:.0f} "
      f"p99 {r['ttft_ms']['p99']:.0f} ms, server TTFT mean {s['mean_ms']:.0f} ms, ITL p50 {r['itl_ms']['p50']:.2f} "
      f"p99 {r['itl_ms']['p99']:.1f} ms, API process {1e6 * api_cpu / r['output_tokens']:.0f} CPU µs per "
      f"output token, {r['failed']} failed")
PY
  done
done
