#!/usr/bin/env bash
# One call on the GPU machine: set up, check, benchmark. Results land in $OUT (the device
# tool's output folder) or ./.out, to be copied into docs/benchmarks/.
#
#   bash benchmarks/run_gpu.sh [all|parity|parity-triton|kernels|kernels-attention|tests|graphs|serve|
#                                               overhead|topology|e2e[-throughput|-startup|-profile|-latency]|
#                                               multi-gpu|offline-llm|vllm-stash|vllm|structured|
#                                               multi-gpu-tests|multi-gpu-one|vllm-moe-stash|multi-gpu-vllm|
#                                               kv-offload|kv-offload-tests|kv-offload-fit|kv-load-bandwidth|elastic|elastic-bench|serve-sweep|multi-gpu-ab|pd|prefill-ab|
#                                               prefill-profile|kernels-prefill|kernels-moe|
#                                               all-reduce|dp|eplb|api-compat|lora-tests|lora-bench|lora-vllm|
#                                               pooling-tests|embed-vllm|embed-serve|rerank-vllm|rerank-serve|
#                                               rerank-rounds] ...
#
# e2e: end-to-end engine benchmarks on random-weight models (benchmarks/throughput.py). The default
# throughput run times the workload E2E_ROUNDS times (2) on one engine, with the Triton
# kernels compiled during each round.
# vllm-stash / vllm: the two steps of the vLLM anchor kit (../shared/anchors/vllm), made as
# two device calls back to back: the first carries .vllm_stash (core.part.00), the second
# carries .vllm_b (core.part.01, SHA256SUMS, stage2.sh, bench_vllm.py, model configs) and
# runs vLLM and then Pagoda's e2e throughput on the same machine.
# structured: constrained decoding's cost (issue #22): the nano-vllm workload with half of its
# requests under JSON schemas beside it unconstrained, Pagoda (benchmarks/structured_outputs.py)
# and vLLM 0.26.0 (benchmarks/vllm_structured.py) on a synthetic Qwen3-size tokenizer
# (benchmarks/synthetic_tokenizer.py). Two calls back to back, as for vllm: `vllm-stash`
# carrying .vllm_stash, then `structured` carrying .whl (xgrammar 0.2.8, apache-tvm-ffi,
# jsonschema) and .vllm_b; without .vllm_b it runs Pagoda's side alone.
# multi-gpu (2+ GPUs): multi-gpu-tests (NCCL parity with transformers, pagoda serve on both GPUs),
# multi-gpu-one (Pagoda on one of the GPUs: the baselines), multi-gpu-vllm (for each MG_LAYOUTS
# entry, vLLM 0.26.0 then Pagoda at the same layout, benchmarks/vllm_throughput.py). vLLM needs
# the kit in pieces, one call each and back to back on the same machine: `vllm-stash` carrying
# .vllm_stash (core.part.00), `vllm-moe-stash` carrying .vllm_moe (moe.tar.xz, for Qwen3-MoE),
# then `multi-gpu-vllm` carrying .vllm_b (core.part.01, SHA256SUMS).
#
# The GPU image has torch, transformers, safetensors and tokenizers; anything else the
# steps need travels as wheels in .whl/ (the server's: fastapi, uvicorn, pyzmq, pydantic, ...).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/.out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:$PWD/daemon:$PWD/kernels:$PWD/operator${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi

step() { echo; echo "=== $1 ($(date -u +%T))"; }
status=0

step device
{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import sys, torch, transformers; print("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__, "cuda", torch.version.cuda)'
  python3 -c 'import triton; print("triton", triton.__version__)' 2>/dev/null || true
} | tee "$OUT/device.txt"

want() { [ "$#" -eq 0 ] && return 0; }
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(all)
has() { for s in "${steps[@]}"; do [ "$s" = "$1" ] || [ "$s" = all ] && return 0; done; return 1; }

if has offline-llm; then
  step "the offline LLM: its first batch against its second, built without and with its warm-up (Qwen3-0.6B shape)"
  for extra in --skip-llm-warm-up ""; do
    python3 -m benchmarks.throughput benchmarks/configs/qwen3-0.6b --offline-llm --rounds 2 $extra \
      | grep '^RESULT' | tee -a "$OUT/offline-llm.jsonl" || status=1
  done
fi
if has parity; then
  step "parity with transformers on CUDA (float32 must be identical; bfloat16 reported)"
  python3 -m benchmarks.parity --device cuda --dtypes float32 bfloat16 | tee "$OUT/parity.jsonl" || status=1
fi
if has parity-triton; then
  step "parity with transformers on CUDA through the Triton attention backend"
  python3 -m benchmarks.parity --device cuda --dtypes float32 bfloat16 --attention-backend triton \
    --configs default chunked-prefill-16 shared-prefix-cached tiny-cache-preemption | tee "$OUT/parity-triton.jsonl" || status=1
fi
if has kernels; then
  step "Triton kernels: GPU correctness grid, then benchmarks against the copy/matmul rates of this run"
  python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_gpu.py 2>&1 | tail -15 | tee "$OUT/kernels-pytest.txt" || status=1
  python3 -m benchmarks.kernels --out "$OUT/kernels-bench.json" | tail -40 || status=1
fi
if has kernels-attention; then
  step "Triton attention and sampling kernels: their GPU tests, then their benchmarks"
  python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_gpu.py -k "decode or prefill or varlen or backend or sampl" \
    2>&1 | tail -15 | tee "$OUT/kernels-pytest.txt" || status=1
  python3 -m benchmarks.kernels --only decode,decode-mixed,prefill,sampling --out "$OUT/kernels-bench.json" | tail -40 \
    || status=1
fi
if has gpu-tests; then
  step "GPU tests: kernel grid, CUDA graphs, transformers parity"
  python3 -m pytest -q -p no:cacheprovider -rf tests/gpu 2>&1 | tail -25 | tee "$OUT/gpu-pytest.txt" || status=1
fi
if has tests; then
  step "pytest on the GPU machine (GPU tests and the CPU suite on this host)"
  if python3 -c 'import pytest' 2>/dev/null; then
    python3 -m pytest -q -p no:cacheprovider tests/gpu tests/engine tests/models tests/topology 2>&1 | tee "$OUT/pytest.txt" || status=1
  else
    echo "pytest is not installed here: carry it in .whl/" | tee "$OUT/pytest.txt"
  fi
fi
if has serve; then
  step "pagoda serve on the GPU: completion, chat, metrics, SIGTERM drain"
  python3 -c 'from pagoda_daemon.models.tiny import build_tiny_model; build_tiny_model("llama", "/tmp/tiny-llama")'
  python3 -m pagoda_daemon --log-level INFO serve /tmp/tiny-llama --port 18000 --served-model-name tiny \
    --device cuda --dtype bfloat16 > "$OUT/serve.log" 2>&1 &
  SERVE_PID=$!
  for _ in $(seq 1 120); do curl -sf localhost:18000/ready > "$OUT/serve-ready.json" && break; sleep 1; done
  cat "$OUT/serve-ready.json"; echo
  curl -s localhost:18000/v1/completions -H 'content-type: application/json' \
    -d '{"model":"tiny","prompt":"Hello","max_tokens":8,"temperature":0}' | tee "$OUT/serve-completion.json"; echo
  curl -s localhost:18000/v1/chat/completions -H 'content-type: application/json' \
    -d '{"model":"tiny","messages":[{"role":"user","content":"Hi"}],"max_tokens":8,"stream":true}' | tail -3
  curl -s localhost:18000/metrics | grep -E '^vllm:(generation_tokens_total|request_success_total|kv_cache_usage)'
  kill -TERM $SERVE_PID; wait $SERVE_PID; echo "serve exit code: $?" | tee -a "$OUT/serve-completion.json"
fi
if has graphs; then
  step "CUDA graphs: graphed decode equals eager, padding, eager fallback"
  python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_graphs.py 2>&1 | tail -15 | tee "$OUT/graphs-pytest.txt" || status=1
fi
CFG=benchmarks/configs
# vLLM 0.26.0 into /tmp/vsite from the kit's two halves (core.part.00 stashed by an earlier call,
# core.part.01 in .vllm_b), and its MoE kernels once moe.tar.xz is here or stashed; once each per machine.
unpack_vllm() {
  local p0="" d
  if [ ! -f /tmp/vsite/vllm/__init__.py ]; then
    for d in .vllm_stash /tmp/vllm_stash; do [ -f $d/core.part.00 ] && { p0=$d/core.part.00; break; }; done
    [ -n "$p0" ] && [ -f .vllm_b/core.part.01 ] || { echo "vLLM kit incomplete: core.part.00 (stashed) and .vllm_b needed"; return 1; }
    cat "$p0" .vllm_b/core.part.01 > /tmp/core.tar.xz
    grep ' core.tar.xz$' .vllm_b/SHA256SUMS | sed 's# core.tar.xz$# /tmp/core.tar.xz#' | sha256sum -c - || return 1
    python3 -c "import tarfile; tarfile.open('/tmp/core.tar.xz').extractall('/tmp/vsite', filter='fully_trusted')" || return 1
  fi
  if [ -d .vllm_b/vwhl ] && [ ! -f /tmp/vsite/.vwhl_added ]; then  # what `vllm serve` needs beyond the engine
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vsite .vllm_b/vwhl/*.whl \
      && touch /tmp/vsite/.vwhl_added
  fi
  for d in .vllm_moe /tmp/vllm_stash; do
    if [ -f $d/moe.tar.xz ] && [ ! -f /tmp/vsite/.moe_added ]; then
      python3 -c "import tarfile; tarfile.open('$d/moe.tar.xz').extractall('/tmp/vsite', filter='fully_trusted')" \
        && touch /tmp/vsite/.moe_added && echo "vLLM MoE kernels added"; break
    fi
  done
}
# /tmp/vsite (unpacked first) when the vLLM kit is here, for a benchmark's PYTHONPATH; nothing
# otherwise, and the benchmark reports vLLM's side as an error row.
vllm_kit_path() { { [ -f /tmp/vsite/vllm/__init__.py ] || [ -f .vllm_b/core.part.01 ]; } && unpack_vllm >/dev/null && echo /tmp/vsite; }
if has vllm-stash; then
  step "vLLM anchor, step 1: stash core.part.00"
  mkdir -p /tmp/vllm_stash && cp .vllm_stash/* /tmp/vllm_stash/ && ls -la /tmp/vllm_stash || status=1
fi
if has vllm; then
  step "vLLM anchor, step 2: vLLM 0.26.0 on the Qwen3-0.6B shape (nano-vllm workload)"
  B=.vllm_b OUT=$OUT bash .vllm_b/stage2.sh engine 2>&1 | grep -E "RESULT|Error|error|vllm " | tail -5 || status=1
  grep RESULT "$OUT/vllm_bench.log" | tee "$OUT/vllm.jsonl"
fi
if has kv-offload; then
  # Issue #19's workload: conversations on a long shared context outgrowing a GPU cache held to
  # KVO_BLOCKS blocks, with offload off, in host memory, on disk and both (Qwen3-0.6B shape,
  # random weights, the synthetic tokenizer). KVO_BLOCKS empty: the cache sized as in production.
  # KVO_DISK_GIB: the disk tier's size (kv_offload.py's default, 64 GiB, otherwise); the disk and
  # both configurations keep their files until the run ends, which a 64 GiB disk may not hold.
  step "KV offload: multi-turn conversations beyond the GPU cache (off, cpu, disk, both)"
  # KVO_CPU_GIB: the host tier's size (16 GiB otherwise). KVO_BASE: a copy of an earlier daemon/,
  # kernels/ and benchmarks/ (`git archive`), run after this tree with KVO_BASE_CONFIGS.
  # KVO_MODEL: a directory of benchmarks/configs (qwen3-0.6b); KVO_CONCURRENCY: conversations in
  # flight (all otherwise); KVO_MAX_LEN: --max-model-len (32768; the cache needs one sequence of it);
  # KVO_TURN_DELAY: seconds between a conversation's answer and its next turn (1); KVO_RATE:
  # conversations starting per second (all at once otherwise); KVO_SHARED: tokens every conversation
  # shares (2000); KVO_DOCUMENT: tokens of each conversation's own document after them (0).
  KVO_MODEL=${KVO_MODEL:-qwen3-0.6b}; TOK=/tmp/$KVO_MODEL-synth
  python3 -m benchmarks.synthetic_tokenizer $TOK --config $CFG/$KVO_MODEL/config.json >/dev/null || status=1
  for tree in head ${KVO_BASE:+base}; do
    root=$PWD; configs=${KVO_CONFIGS:-off,cpu,disk,both}
    [ "$tree" = base ] && root=$PWD/$KVO_BASE && configs=${KVO_BASE_CONFIGS:-cpu}
    (cd "$root" && PYTHONPATH=$root:$root/daemon:$root/kernels:$PYTHONPATH timeout "${KVO_TIMEOUT:-540}" \
      python3 -m benchmarks.kv_offload $CFG/$KVO_MODEL --tokenizer $TOK --load-format dummy \
      ${KVO_CONCURRENCY:+--max-concurrency $KVO_CONCURRENCY} ${KVO_MAX_LEN:+--max-model-len $KVO_MAX_LEN} \
      ${KVO_TURN_DELAY:+--turn-delay $KVO_TURN_DELAY} ${KVO_RATE:+--conversation-rate $KVO_RATE} \
      ${KVO_BLOCKS:+--num-kv-blocks $KVO_BLOCKS} --conversations "${KVO_CONVERSATIONS:-100}" --turns "${KVO_TURNS:-10}" \
      --shared-len "${KVO_SHARED:-2000}" ${KVO_DOCUMENT:+--document-len $KVO_DOCUMENT} ${KVO_CPU_GIB:+--cpu-gib $KVO_CPU_GIB} ${KVO_DISK_GIB:+--disk-gib $KVO_DISK_GIB} \
      --configs "$configs" --out "$OUT/kv_offload.jsonl" $([ "$tree" = head ] && echo --label head)) \
      2>&1 | tail -8; [ "${PIPESTATUS[0]}" = 0 ] || status=1
  done
fi
if has kv-load-bandwidth; then
  # How fast host-memory blocks reach the GPU cache (benchmarks/kv_load_bandwidth.py): one
  # contiguous copy (the link's peak), the host tier's load, and the kernel reading pinned slots.
  step "KV load bandwidth: host slots into the paged cache"
  for layers in ${KVL_LAYERS:-28 32}; do
    python3 -m benchmarks.kv_load_bandwidth --layers "$layers" --blocks "${KVL_BLOCKS:-64,256,1024}" \
      --programs "${KVL_PROGRAMS:-0,16,32,64,132}" --label "layers-$layers" 2>&1 | grep -E '^RESULT|host tier|Error|error' \
      | tee -a "$OUT/kv-load-bandwidth.jsonl"; [ "${PIPESTATUS[0]}" = 0 ] || status=1
  done
fi
if has kv-offload-fit; then
  # Issue #19's other goal: what offload costs when everything fits the GPU cache (every full
  # block saved to host memory when written through, none ever read back): the nano-vllm
  # workload, off and with a KVF_CPU_GIB host tier under each of KVF_POLICIES, alternated
  # KVF_REPEATS times; fresh prompt ids each round.
  step "KV offload when prefixes fit: throughput with and without a host tier"
  for model in ${KVF_MODELS:-qwen3-0.6b llama3-8b}; do
    for i in $(seq "${KVF_REPEATS:-2}"); do
      for run in off ${KVF_POLICIES:-write-through write-back}; do
        gib=0; policy=()
        [ "$run" != off ] && gib=${KVF_CPU_GIB:-16} && policy=(--kv-offload-write-policy "$run")
        python3 -m benchmarks.throughput $CFG/$model --rounds 2 --fresh-prompts-per-round \
          --kv-offload-cpu-gib "$gib" "${policy[@]}" --label "fit-$model-$run-$i" 2>&1 \
          | grep -E '^RESULT|Error' | tee -a "$OUT/kv-offload-fit.jsonl"; [ "${PIPESTATUS[0]}" = 0 ] || status=1
      done
    done
  done
fi
if has kv-offload-tests; then
  step "KV offload on the GPU: asynchronous host copies and failed loads against the engine without offload"
  python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kv_offload_gpu.py 2>&1 | tail -5 \
    | tee "$OUT/kv-offload-pytest.txt"; [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if has structured; then
  step "structured outputs: 50% of the nano-vllm workload under JSON schemas (Pagoda, then vLLM 0.26.0)"
  SO=$OUT/structured.jsonl; TOK=/tmp/qwen3-0.6b-synth
  if python3 -c 'import pytest' 2>/dev/null; then  # the GPU path's correctness first
    python3 -m pytest -q -p no:cacheprovider tests/gpu/test_structured_outputs_gpu.py 2>&1 | tail -5 \
      | tee "$OUT/structured-pytest.txt" || status=1
  fi
  python3 -m benchmarks.synthetic_tokenizer $TOK --config $CFG/qwen3-0.6b/config.json || status=1
  python3 -c 'import importlib.metadata as m, xgrammar, jsonschema; print("xgrammar", m.version("xgrammar"))' || status=1
  # ROOT TIMEOUT ARGS...: the benchmark of the tree at ROOT (this one, or SO_BASE's) on its engine
  so() { (cd "$1" && PYTHONPATH=$1:$1/daemon:$1/kernels:$PYTHONPATH timeout "$2" python3 -m benchmarks.structured_outputs \
           $CFG/qwen3-0.6b --tokenizer $TOK "${@:3}") 2>&1 \
           | tee -a "$OUT/pagoda_structured.log" | grep -E '^RESULT|Error' | tee -a "$SO"; [ "${PIPESTATUS[0]}" = 0 ] || status=1; }
  # the engine as it is: a json round that has not finished after SO_ROUND_TIMEOUT s is cut there
  # SO_BACKENDS: the engine with each structured-outputs backend in turn (llguidance needs its wheel in .whl);
  # SO_BASE: a copy of an earlier daemon/, kernels/ and benchmarks/ (`git archive`), run after this tree
  for tree in head ${SO_BASE:+base}; do
    root=$PWD; [ "$tree" = base ] && root=$PWD/$SO_BASE
    for backend in ${SO_BACKENDS:-xgrammar}; do
      [ -z "${SO_SKIP_PAGODA:-}" ] && so "$root" "${SO_TIMEOUT:-240}" --round-timeout "${SO_ROUND_TIMEOUT:-60}" \
        --rounds "${SO_ROUNDS:-plain,json,json,matched,plain}" --structured-outputs-backend "$backend" --label "pagoda-$tree"
    done
  done
  # the mask fill alone on this host: one matcher per schema, then 128 at once by thread count
  if [ -z "${SO_SKIP_MASK_CPU:-}" ]; then
    python3 -m benchmarks.structured_mask_cpu --tokenizer $TOK --variants engine --max-tokens 200 --batch 128 \
      --threads 1,2,4,8,16 2>&1 | grep -E '^RESULT|Error' | sed 's/^RESULT /RESULT {"mask_cpu": true, /; s/, {/, /' \
      | tee -a "$SO" || status=1
  fi
  if [ -f .vllm_b/core.part.01 ] && [ -z "${SO_SKIP_VLLM:-}" ]; then
    unpack_vllm || status=1
    # beside (not inside) vLLM's own site-packages: jsonschema, for the check of its outputs, and
    # lm-format-enforcer + interegular (.vllm_b/sowhl), which vLLM 0.26.0 imports to validate any
    # structured-output request whatever its backend, and which the anchor kit leaves out
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/jsite .whl/jsonschema*.whl \
      .whl/referencing*.whl .whl/rpds_py*.whl .vllm_b/sowhl/*.whl 2>&1 | grep -v -i warn
    PYTHONPATH=/tmp/vsite:/tmp/jsite VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 TRANSFORMERS_OFFLINE=1 \
      timeout 280 python3 benchmarks/vllm_structured.py $TOK --rounds "${SO_VLLM_ROUNDS:-plain,json,json,matched}" 2>&1 \
      | tee "$OUT/vllm_structured.log" | grep -E '^RESULT' | tee -a "$SO"; [ "${PIPESTATUS[0]}" = 0 ] || status=1
  fi
fi
T="python3 -m benchmarks.throughput"
e2e() { $T "$@" 2>&1 | grep RESULT | tee -a "$OUT/e2e.jsonl"; [ "${PIPESTATUS[0]}" = 0 ] || status=1; }
# Pagoda's steady decode steps profiled (256 sequences, 20 steps, rank 0's view: its NCCL kernels
# include the time they wait for the other ranks); the arguments are the throughput command
# (with any env prefix) and its flags; its RESULT lines on stdout.
decode_profile() { timeout 150 "$@" --num-seqs 256 --profile-steps 20 2>&1 | grep RESULT; }
if has prefill-ab; then
  # Issue #20: steps that carry prompts. GPU tests of the graphs and parity first, then for this
  # tree and each of PA_BASE (earlier copies of daemon/ and kernels/): the engine's TTFT for a
  # 562-token prompt joining 4 and 16 decoding requests (host time per phase and op), and the
  # nano-vllm workload's throughput (one round after warm-up), all on this machine.
  step "prompt-carrying steps: GPU tests, then engine TTFT and throughput, this tree and ${PA_BASE:-(no base)}"
  if [ "${PA_TEST_TIMEOUT:-300}" != 0 ]; then  # 0: the tests passed in an earlier call on this machine
    timeout "${PA_TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_graphs.py tests/gpu/test_cuda_parity.py 2>&1 \
      | tail -4 | tee "$OUT/prefill-ab-pytest.txt"; grep -q -E "failed|error" "$OUT/prefill-ab-pytest.txt" && status=1
  fi
  for tree in head ${PA_BASE:-}; do
    root=$PWD; [ "$tree" != head ] && root=$PWD/$tree
    label=${tree#.}; env=(env PYTHONPATH=$root/daemon:$root/kernels:$PYTHONPATH PROFILE_TOP_KERNELS=6 PROFILE_TOP_OPS=8)
    for n in 4 16; do
      "${env[@]}" timeout 120 $T $CFG/qwen3-0.6b --num-seqs $n --max-input-len 600 --max-output-len 3000 \
        --profile-steps 20 --profile-prefill-len 562 --max-model-len 8192 --label "$label" 2>&1 | grep RESULT \
        | tee -a "$OUT/prefill-ab.jsonl" || status=1
    done
    "${env[@]}" timeout 150 $T $CFG/qwen3-0.6b --label "$label" 2>&1 | grep RESULT | tee -a "$OUT/prefill-ab.jsonl" || status=1
  done
fi
if has kernels-prefill; then
  # Issue #20: the prefill kernel's GPU tests, then its tile sweep (16 / 8 heads, 4,096 tokens,
  # paged and contiguous) beside vLLM's FlashAttention 3 on the paged case when the vLLM kit is
  # here (unpacked, or a `vllm-stash` call first and .vllm_b carried).
  step "prefill attention: GPU tests, tile sweep, FA3 beside it"
  python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_gpu.py -k "prefill or varlen or backend" \
    2>&1 | tail -5 | tee "$OUT/kernels-pytest.txt" || status=1
  vpath=$(vllm_kit_path)
  PYTHONPATH=$PYTHONPATH${vpath:+:$vpath} python3 -m benchmarks.kernels --only prefill,prefill-sweep \
    --out "$OUT/kernels-prefill.json" | tail -60 || status=1
fi
if has kernels-moe; then
  # Issue #20: the fused MoE's GPU tests, then its grouped GEMMs' tiles at prompt-sized steps
  # (1,024-8,192 tokens, Qwen3-30B-A3B shape) beside vLLM's fused_experts when the vLLM kit is here
  # (`vllm-stash` and `vllm-moe-stash` calls first, .vllm_b carried).
  step "fused MoE: GPU tests, tile sweep at prompt-sized steps, vLLM's beside it"
  python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_gpu.py -k "${KM_TESTS:-moe}" \
    2>&1 | tail -5 | tee "$OUT/kernels-pytest.txt"; grep -q -E "failed|error" "$OUT/kernels-pytest.txt" && status=1
  vpath=$(vllm_kit_path)
  PYTHONPATH=$PYTHONPATH${vpath:+:$vpath} python3 -m benchmarks.kernels --only moe-sweep \
    --out "$OUT/kernels-moe.json" | tail -5 || status=1
fi
if has prefill-profile; then
  # Issue #20: the prefill-heavy workload (200 prompts of 3,072-5,120 tokens, 192-320 out, all at
  # once; Qwen3-0.6B shape) offline, Pagoda then vLLM 0.26.0 at the serve default of 8,192 tokens
  # a step: Pagoda's per-step log ($OUT/pagoda-steps.jsonl) and GPU time per kernel over the whole
  # run, vLLM's throughput and its kernel table over every step (profiler_out_0.txt). Needs the
  # vLLM kit as for `vllm` (a `vllm-stash` call first); PP_NO_VLLM=1: Pagoda alone.
  step "prefill-heavy offline: Pagoda step log and kernels, then vLLM's"
  PH=(--num-seqs 200 --min-input-len 3072 --max-input-len 5120 --min-output-len 192 --max-output-len 320
      --max-model-len 8192 --max-num-batched-tokens 8192)
  timeout 200 $T $CFG/qwen3-0.6b "${PH[@]}" --max-num-seqs 1024 --step-log "$OUT/pagoda-steps.jsonl" --label steps \
    ${PP_PAGODA_ARGS:-} 2>&1 | grep RESULT | tee -a "$OUT/prefill-profile.jsonl" || status=1
  timeout 200 $T $CFG/qwen3-0.6b "${PH[@]}" --max-num-seqs 1024 --profile-run --label kernels ${PP_PAGODA_ARGS:-} 2>&1 \
    | grep RESULT | tee -a "$OUT/prefill-profile.jsonl" || status=1
  if [ -z "${PP_NO_VLLM:-}" ] && unpack_vllm; then
    V=(env PYTHONPATH=/tmp/vsite:$PYTHONPATH python3 -m benchmarks.vllm_throughput $CFG/qwen3-0.6b "${PH[@]}")
    timeout 240 "${V[@]}" 2>&1 | grep RESULT | tee -a "$OUT/prefill-profile.jsonl" || status=1
    timeout 300 "${V[@]}" --profile-dir /tmp/vprof --profile-delay 0 --profile-steps 5000 2>&1 | grep RESULT \
      | tee -a "$OUT/prefill-profile.jsonl" || status=1
    cp /tmp/vprof/*.txt "$OUT/" 2>/dev/null; ls -la /tmp/vprof
  fi
fi
if has e2e || has e2e-throughput || has vllm; then
  step "Pagoda end to end: Qwen3-0.6B shape, nano-vllm workload (CUDA graphs + async scheduling), ${E2E_ROUNDS:-2} rounds"
  e2e $CFG/qwen3-0.6b --rounds "${E2E_ROUNDS:-2}"
fi
if has e2e || has e2e-throughput; then
  step "the same without async scheduling, then without CUDA graphs"
  e2e $CFG/qwen3-0.6b --no-async-scheduling
  e2e $CFG/qwen3-0.6b --enforce-eager
fi
if has e2e || has e2e-startup; then
  step "Pagoda start-up: process start to ready"
  e2e $CFG/qwen3-0.6b --startup
fi
if has e2e || has e2e-profile; then
  step "Pagoda profile: decode steps at 256 sequences, with and without async scheduling"
  e2e $CFG/qwen3-0.6b --profile-steps 20 --trace-dir "$OUT/trace"
  e2e $CFG/qwen3-0.6b --profile-steps 20 --no-async-scheduling
fi
if has e2e || has e2e-latency; then
  step "Pagoda batch-1 decode latency: Llama-3-8B shape against the weight-read floor"
  e2e $CFG/llama3-8b --latency
  e2e $CFG/llama3-8b --latency --no-async-scheduling
fi
if has overhead; then
  step "engine CPU overhead per step at 256 running requests"
  python3 -m benchmarks.step_overhead --num-requests 256 --steps 200 | tee "$OUT/step_overhead.json" || status=1
fi
if has topology; then
  step "node topology and pinning"
  python3 -m pagoda_daemon.topology --json > "$OUT/topology.json" 2> "$OUT/topology.stderr" || status=1
  head -c 3000 "$OUT/topology.json"; echo
  if [ -f daemon/pagoda_daemon/topology/bench_pinning.py ]; then
    python3 -m pagoda_daemon.topology.bench_pinning --gpu 0 --sizes-mib 1,16,64,256 --repeats 30 | tee "$OUT/pinning.json" || status=1
  fi
fi
if has multi-gpu || has multi-gpu-tests; then
  step "two GPUs: tensor and expert parallelism (NCCL), float32 parity with transformers, pagoda serve"
  nvidia-smi topo -m | head -5 | tee "$OUT/topo.txt"
  # Written to a file first: a pipe cut by the timeout loses what the tests printed.
  # MG_TEST_K: a pytest -k expression, to run some of the tests only
  timeout "${MG_TEST_TIMEOUT:-600}" python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_multi_gpu.py \
    ${MG_TEST_K:+-k "$MG_TEST_K"} >"$OUT/multi-gpu-pytest.txt" 2>&1 || status=1
  tail -40 "$OUT/multi-gpu-pytest.txt"
fi
if has all-reduce; then
  # The tensor-parallel all-reduce by size: NCCL against the reads of the peers' memory and torch's
  # one-shot kernel (benchmarks/all_reduce.py), and the GPU test of that path against NCCL's sums
  step "all-reduce on ${AR_RANKS:-2} GPUs: NCCL against the peers' memory, by size"
  timeout 120 python3 -m benchmarks.all_reduce --ranks "${AR_RANKS:-2}" 2>&1 | tee "$OUT/all-reduce.log" \
    | grep RESULT | tee -a "$OUT/all-reduce.jsonl" || { status=1; tail -30 "$OUT/all-reduce.log"; }
  timeout 120 python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_peer_all_reduce.py 2>&1 | tail -5 \
    | tee "$OUT/peer-all-reduce-pytest.txt"; grep -q " passed" "$OUT/peer-all-reduce-pytest.txt" || status=1
fi
if has elastic; then
  # Elastic EP over NCCL (issue #18): the tiny Qwen3-MoE resized 1 -> 2 -> 1 while requests run
  step "elastic expert parallelism on two GPUs: 1 -> 2 -> 1 over NCCL"
  timeout "${ELASTIC_TIMEOUT:-300}" python3 -m pytest -q -s -p no:cacheprovider -rf tests/gpu/test_elastic_ep_gpu.py \
    >"$OUT/elastic-pytest.txt" 2>&1 || status=1
  grep -E "ELASTIC_GPU|passed|failed|Error" "$OUT/elastic-pytest.txt" | tail -20
fi
if has elastic-bench; then
  # Elastic EP at the Qwen3-30B-A3B shape (issue #18): 2 -> 4 -> 2 idle and under the nano-vllm
  # workload, on one engine (benchmarks/elastic_ep.py); needs ELASTIC_BENCH_GROW_TO GPUs.
  step "elastic expert parallelism, Qwen3-30B-A3B shape: ${ELASTIC_BENCH_START:-2} -> ${ELASTIC_BENCH_GROW_TO:-4} -> ${ELASTIC_BENCH_START:-2}"
  nvidia-smi topo -m | tee "$OUT/topo.txt"
  timeout "${ELASTIC_BENCH_TIMEOUT:-400}" python3 -m benchmarks.elastic_ep $CFG/qwen3-30b-a3b \
    --start "${ELASTIC_BENCH_START:-2}" --grow-to "${ELASTIC_BENCH_GROW_TO:-4}" >"$OUT/elastic-bench.log" 2>&1 || status=1
  grep -E "elastic EP|seconds by part|start-up: (memory|KV)" "$OUT/elastic-bench.log" | tail -30
  grep '^RESULT' "$OUT/elastic-bench.log" | tee -a "$OUT/elastic-bench.jsonl" || { status=1; tail -30 "$OUT/elastic-bench.log"; }
fi
if has vllm-moe-stash; then
  step "vLLM anchor, MoE kernels: stash moe.tar.xz"
  mkdir -p /tmp/vllm_stash && cp .vllm_moe/moe.tar.xz /tmp/vllm_stash/ && ls -la /tmp/vllm_stash || status=1
fi
if has multi-gpu || has multi-gpu-one; then
  step "one GPU of the machine: the baselines of the parallel layouts (Pagoda)"
  for m in ${MG_ONE_GPU_MODELS:-llama3-8b qwen3-30b-a3b}; do
    CUDA_VISIBLE_DEVICES=0 timeout 300 $T $CFG/$m 2>&1 | grep RESULT | tee -a "$OUT/e2e.jsonl"
  done
fi
if has multi-gpu || has multi-gpu-vllm; then
  # MG_LAYOUTS: MODEL:TENSOR:EXPERT ...; each runs vLLM 0.26.0 then Pagoda, one after the other on
  # this machine (vLLM's EP is --enable-expert-parallel at tensor size TENSOR x EXPERT).
  step "two GPUs: vLLM 0.26.0 and Pagoda at the same parallelism (nano-vllm workload)"
  unpack_vllm || status=1
  for layout in ${MG_LAYOUTS:-llama3-8b:2:1 qwen3-30b-a3b:1:2 qwen3-30b-a3b:2:1}; do
    IFS=: read -r m tp ep <<<"$layout"
    vflags="--tensor-parallel-size $((tp * ep))"; [ "$ep" -gt 1 ] && vflags="$vflags --enable-expert-parallel"
    # MG_VLLM_PROFILE=1: vLLM's timed run also profiles 20 engine steps after its first 40 (its
    # kernel table per rank lands in $OUT/vllm-profile-<layout>/); MG_VLLM_FLAGS: more vLLM flags
    if [ -f /tmp/vsite/vllm/__init__.py ] && [ -z "${MG_SKIP_VLLM:-}" ]; then
      prof=""; [ -n "${MG_VLLM_PROFILE:-}" ] && prof="--profile-dir /tmp/vprof-$m-$tp-$ep"
      PYTHONPATH=/tmp/vsite timeout "${MG_VLLM_TIMEOUT:-300}" python3 -m benchmarks.vllm_throughput $CFG/$m $vflags \
        ${MG_VLLM_FLAGS:-} $prof > "$OUT/vllm-$m-$tp-$ep.log" 2>&1; grep RESULT "$OUT/vllm-$m-$tp-$ep.log" \
        | tee -a "$OUT/vllm.jsonl" || { status=1; tail -20 "$OUT/vllm-$m-$tp-$ep.log"; }
      [ -n "$prof" ] && { mkdir -p "$OUT/vllm-profile-$m-$tp-$ep"; cp /tmp/vprof-$m-$tp-$ep/*.txt "$OUT/vllm-profile-$m-$tp-$ep/" \
        || status=1; head -40 "$OUT/vllm-profile-$m-$tp-$ep/profiler_out_0.txt"; }
    fi
    # MG_PAGODA_VARIANTS: Pagoda flag sets separated by ';' (an empty one: the defaults), each run in turn
    IFS=';' read -r -a variants <<<"${MG_PAGODA_VARIANTS:-}"; [ ${#variants[@]} = 0 ] && variants=("")
    for i in "${!variants[@]}"; do
      timeout "${MG_PAGODA_TIMEOUT:-300}" $T $CFG/$m --tensor-parallel-size $tp --expert-parallel-size $ep \
        ${variants[$i]} --label "variant $i: ${variants[$i]:-defaults}" 2>&1 | tee "$OUT/pagoda-$m-$tp-$ep-$i.log" \
        | grep RESULT | tee -a "$OUT/e2e.jsonl" || { status=1; tail -20 "$OUT/pagoda-$m-$tp-$ep-$i.log"; }
    done
    # MG_PAGODA_PROFILE=1: Pagoda's steady decode steps profiled too (256 sequences, 20 steps, rank 0)
    [ -n "${MG_PAGODA_PROFILE:-}" ] && { decode_profile $T $CFG/$m --tensor-parallel-size $tp --expert-parallel-size $ep \
      | tee -a "$OUT/e2e.jsonl" || status=1; }
  done
fi
if has multi-gpu-ab; then
  # A change to the parallel path against the tree it started from, in the same call: for each
  # MG_LAYOUTS entry (MODEL:T:E; T = 0: one GPU) Pagoda from this tree, then from MG_BASE (a copy
  # of an earlier daemon/ and kernels/, e.g. from `git archive`), which so runs with the Triton
  # cache warm; MG_PROFILE_LAYOUT profiled over steady decode steps (rank 0's view: its NCCL
  # kernels include the time they wait for the other ranks).
  step "parallel layouts: this tree, then ${MG_BASE:-(no base)}, same machine"
  nvidia-smi topo -m | head -5 | tee "$OUT/topo.txt"
  [ -n "${MG_KERNEL_TESTS:-}" ] && { python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_gpu.py \
    -k "$MG_KERNEL_TESTS" 2>&1 | tail -3 | tee "$OUT/kernels-pytest.txt"; grep -q failed "$OUT/kernels-pytest.txt" && status=1; }
  for layout in ${MG_LAYOUTS:-qwen3-30b-a3b:1:2 llama3-8b:2:1}; do
    IFS=: read -r m tp ep <<<"$layout"
    gpus=""; flags="--tensor-parallel-size $tp --expert-parallel-size $ep"
    [ "$tp" = 0 ] && { gpus=0; flags=""; }
    # MG_BASE may name several trees (space-separated), each run in turn; MG_PROFILE_EACH=1 profiles
    # every tree's steady decode steps after its run (as MG_PROFILE_LAYOUT does for this tree)
    for tree in head ${MG_BASE:-}; do
      root=$PWD; [ "$tree" != head ] && root=$PWD/$tree
      label=${tree#.}; env=(env ${gpus:+CUDA_VISIBLE_DEVICES=$gpus} PYTHONPATH=$root/daemon:$root/kernels:$PYTHONPATH)
      "${env[@]}" timeout "${MG_PAGODA_TIMEOUT:-150}" $T $CFG/$m $flags > "$OUT/ab-$label-$m-$tp-$ep.log" 2>&1
      grep RESULT "$OUT/ab-$label-$m-$tp-$ep.log" | sed "s/^RESULT {/RESULT {\"tree\": \"$label\", /" \
        | tee -a "$OUT/ab.jsonl" || { status=1; tail -20 "$OUT/ab-$label-$m-$tp-$ep.log"; }
      [ -n "${MG_PROFILE_EACH:-}" ] && { decode_profile "${env[@]}" $T $CFG/$m $flags \
        | sed "s/^RESULT {/RESULT {\"tree\": \"$label\", /" | tee -a "$OUT/ab.jsonl" || status=1; }
    done
  done
  if [ -n "${MG_PROFILE_LAYOUT:-}" ]; then
    IFS=: read -r m tp ep <<<"$MG_PROFILE_LAYOUT"
    decode_profile $T $CFG/$m --tensor-parallel-size $tp --expert-parallel-size $ep | tee -a "$OUT/ab.jsonl" || status=1
  fi
fi
# The Qwen3-0.6B shape in /tmp/q06 (random weights) with a word-level tokenizer beside its config
# (vllm serve wants one there): what the serving steps serve as model "m".
q06_model() {
  M=/tmp/q06; mkdir -p $M && cp $CFG/qwen3-0.6b/config.json $M/
  python3 -c "from benchmarks.throughput import save_word_level_tokenizer as s; s(151936, '$M')" || status=1
}
# PORT PATH: pagoda serve answers /v1/models before its engine is ready; /ready waits for it
wait_ready() {  # PORT PATH [PID]: until PATH answers 200, for at most 240 s, or PID has exited
  for _ in $(seq 1 240); do
    curl -sf "localhost:$1$2" >/dev/null && return 0
    [ -n "${3:-}" ] && ! kill -0 "$3" 2>/dev/null && return 1
    sleep 1
  done; return 1; }
if has pd; then
  # Issue #19: prefill/decode disaggregation on one GPU (two engines sharing it, the KV through a
  # directory: PD_KV_ROOT, /dev/shm by default, memory-backed) behind pagoda pd-proxy, against one
  # instance with the same share of the GPU; the same request rates from pagoda bench sweep.
  step "prefill/decode disaggregation: pd-proxy over a prefill and a decode instance, then one instance"
  q06_model
  KV=${PD_KV_ROOT:-/dev/shm/pd-kv}; rm -rf "$KV"; mkdir -p "$KV/prefill" "$KV/decode"; df -h "$KV" | tail -1
  pd_serve() {  # NAME PORT FLAGS...: one engine in the background, its pid in PIDS
    python3 -m pagoda_daemon serve $M --load-format dummy --max-model-len 8192 --port "$2" --served-model-name m \
      --device cuda --dtype bfloat16 --seed 0 --gpu-memory-utilization "${PD_UTIL:-0.3}" "${@:3}" > "$OUT/pd-$1.log" 2>&1 &
    PIDS="$PIDS $!"; wait_ready "$2" /ready $! || { status=1; tail -20 "$OUT/pd-$1.log"; return 1; }
  }
  pd_sweep() {  # LABEL PORT
    python3 -m pagoda_daemon bench sweep --iterations 1 --server "$1=http://127.0.0.1:$2" --model m --vocab-size 151936 \
      --input-len "${PD_INPUT_LEN:-2048}" --range-ratio 0.5 --output-len 128 --num-prompts "${PD_PROMPTS:-200}" \
      --workload-var request_rate --values "${PD_RATES:-2,4,8}" --experiment-name pd --output-dir "$OUT/sweep" \
      --resume --no-progress || status=1
  }
  # PD_TRANSPORTS: how the decode instance gets the blocks, one P/D run each: directory (hard links
  # from the prefill instance's tier), tcp (fetched from its transfer port), request (fetched from
  # the port each request's signed header names, as between hosts behind one prefill Service)
  export PAGODA_KV_TRANSFER_KEY=${PAGODA_KV_TRANSFER_KEY:-pd-benchmark-key-0123456789}
  for transport in ${PD_TRANSPORTS:-directory}; do
    rm -rf "$KV"; mkdir -p "$KV/prefill" "$KV/decode"
    case $transport in
      directory) serves=(); source_of_decode="$KV/prefill" ;;
      tcp) serves=(--kv-transfer-port 18400 --kv-transfer-host 127.0.0.1); source_of_decode=tcp://127.0.0.1:18400 ;;
      request) serves=(--kv-transfer-port 18400 --kv-transfer-host 127.0.0.1); source_of_decode=request ;;
      *) echo "unknown PD transport $transport"; status=1; continue ;;
    esac
    label=disaggregated; [ "$transport" != directory ] && label=disaggregated-$transport
    PIDS=""; disk="--kv-offload-disk-gib ${PD_KV_GIB:-24}"
    pd_serve prefill-$transport 18100 --kv-offload-disk-path "$KV/prefill" $disk "${serves[@]}" \
      && pd_serve decode-$transport 18200 --kv-offload-disk-path "$KV/decode" $disk --kv-offload-disk-source "$source_of_decode" \
      || { kill -TERM $PIDS; wait $PIDS; continue; }
    python3 -m pagoda_daemon pd-proxy --prefill http://127.0.0.1:18100 --decode http://127.0.0.1:18200 --port 18000 \
      > "$OUT/pd-proxy-$transport.log" 2>&1 &
    PIDS="$PIDS $!"
    if wait_ready 18000 /health; then
      python3 -m benchmarks.pd_parity --url http://127.0.0.1:18000 --out "$OUT/pd-answers-$label.json" || status=1
      pd_sweep "$label" 18000
    else status=1; tail -20 "$OUT/pd-proxy-$transport.log"; fi
    curl -s localhost:18200/metrics | grep -E '^(vllm:external_prefix_cache_(hits|queries)|pagoda:kv_transfer_fetched_bytes)_total' \
      | tee "$OUT/pd-decode-hits-$transport.txt"
    kill -TERM $PIDS; wait $PIDS; rm -rf "$KV"
  done
  if [ "${PD_SINGLE:-1}" != 0 ]; then  # PD_SINGLE=0: the P/D runs alone (an A/B of two trees)
    PIDS=""; pd_serve single 18300
    python3 -m benchmarks.pd_parity --url http://127.0.0.1:18300 --out "$OUT/pd-answers-single.json" || status=1
    for answers in "$OUT"/pd-answers-disaggregated*.json; do
      python3 -m benchmarks.pd_parity --compare "$answers" "$OUT/pd-answers-single.json" \
        | tee -a "$OUT/pd-parity.txt" || status=1
    done
    pd_sweep single 18300
    kill -TERM $PIDS; wait $PIDS
  fi
  tar czf "$OUT/pd-points.tgz" -C "$OUT" sweep
fi
if has serve-sweep; then
  # Issue #20: `pagoda serve` and `vllm serve` (0.26.0) one after the other on this GPU, the same
  # requests from `pagoda bench sweep` (streamed, token-id prompts): request rates over 400 prompts
  # of 101-1,022 tokens (23-232 out), then a prefill-heavy set (3,072-5,120 in, 192-320 out). Qwen3-0.6B
  # shape, random weights, a word-level tokenizer beside the config (vLLM wants one there). Needs the
  # vLLM kit as for `vllm` (a `vllm-stash` call first) with .vllm_b/vwhl (what `vllm serve` adds).
  # First (unless SW_OFFLINE is empty) each experiment's rate-inf point through the offline LLM
  # (`pagoda bench throughput`, same requests): $OUT/offline-<experiment>.json. SW_TEXT=1: the
  # prompts go as text (the ids decoded by the word-level tokenizer), through the servers' tokenizers.
  step "serving sweeps: pagoda serve, then vllm serve, same requests"
  [ -n "${SW_NO_VLLM:-}" ] || unpack_vllm || status=1
  q06_model
  SW="${SW_RATES-8,24,inf}"; SWP="${SW_PREFILL_RATES-2,inf}"; SWI="${SW_ITERATIONS:-1}"  # "": experiment skipped
  cpu_times() {  # PID: CPU seconds so far of a server's processes (the API server and its children)
    local p; for p in $1 $(pgrep -P "$1"); do echo "$(date -u +%T) $p $(ps -o times= -p "$p") $(ps -o args= -p "$p" | cut -c1-90)"; done
  }
  sweep() {  # LABEL PORT: both experiments against one server
    [ -z "$SW" ] || python3 -m pagoda_daemon bench sweep --iterations "$SWI" --server "$1=http://127.0.0.1:$2" --model m --vocab-size 151936 \
      --input-len 562 --range-ratio 0.82 --output-len 128 --num-prompts 400 --workload-var request_rate \
      --values "$SW" --experiment-name rates --output-dir "$OUT/sweep" --resume --no-progress ${SW_TEXT:+--decode-prompts-with $M} \
      || status=1
    [ -z "$SWP" ] || python3 -m pagoda_daemon bench sweep --iterations "$SWI" --server "$1=http://127.0.0.1:$2" --model m --vocab-size 151936 \
      --input-len 4096 --range-ratio 0.25 --output-len 256 --num-prompts 200 --workload-var request_rate \
      --values "$SWP" --experiment-name prefill-heavy --output-dir "$OUT/sweep" --resume --no-progress \
      ${SW_TEXT:+--decode-prompts-with $M} || status=1
  }
  offline() {  # NAME SWEEP_VALUES DATASET_FLAGS...: the sweep's point at rate inf through the offline LLM
    local name=$1 values=$2 i=0 v; shift 2
    for v in ${values//,/ }; do [ "$v" = inf ] && break; i=$((i + 1)); done
    [ "$v" = inf ] || return 0  # the sweep's seed of a point is its value's index (bench/sweep.py)
    python3 -m pagoda_daemon bench throughput $M --load-format dummy --max-model-len 8192 --device cuda --dtype bfloat16 \
      --seed $i --vocab-size 151936 ${SW_TEXT:+--decode-prompts-with $M} "$@" --result-file "$OUT/offline-$name.json" \
      > "$OUT/offline-$name.log" 2>&1 || status=1
    grep -h output_throughput "$OUT/offline-$name.json" | sed "s/^/offline $name:/"
  }
  if [ -n "${SW_OFFLINE-1}" ]; then  # issue #20: offline within 10% of online at saturation
    [ -z "$SW" ] || offline rates "$SW" --input-len 562 --range-ratio 0.82 --output-len 128 --num-prompts 400
    [ -z "$SWP" ] || offline prefill-heavy "$SWP" --input-len 4096 --range-ratio 0.25 --output-len 256 --num-prompts 200
  fi
  measure() {  # LABEL PORT READY_PATH PID: once the server answers, its sweep and CPU times; then stop it
    if wait_ready "$2" "$3"; then
      echo "$1 serve ready at $(date -u +%T)"
      cpu_times "$4" > "$OUT/$1-cpu.txt"; sweep "$1" "$2"; cpu_times "$4" >> "$OUT/$1-cpu.txt"
    else status=1; tail -20 "$OUT/$1-serve.log"; fi
    kill -TERM "$4"; wait "$4"
  }
  # SW_BASE may name earlier trees (copies of daemon/ and kernels/, space-separated), each served
  # after this one under its own label (the folder's name without its dot): a change against the
  # tree it started from, beside vLLM, in one call. SW_PAGODA_ARGS: more flags for every pagoda
  # serve; SW_NO_VLLM=1: Pagoda's trees alone.
  for tree in head ${SW_BASE:-}; do
    root=$PWD; label=pagoda; [ "$tree" != head ] && { root=$PWD/$tree; label=${tree#.}; }
    PYTHONPATH=$root/daemon:$root/kernels:$PYTHONPATH python3 -m pagoda_daemon serve $M --load-format dummy \
      --max-model-len 8192 --port 18000 --served-model-name m --device cuda --dtype bfloat16 --seed 0 ${SW_PAGODA_ARGS:-} \
      > "$OUT/$label-serve.log" 2>&1 &
    measure "$label" 18000 /ready $!
  done
  if [ -f /tmp/vsite/vllm/__init__.py ] && [ -z "${SW_NO_VLLM:-}" ]; then
    # the kit's settings (stage2.sh): no FlashInfer (not in the kit), offline
    VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_USE_FLASHINFER_SAMPLER=0 TRANSFORMERS_OFFLINE=1 \
      PYTHONPATH=/tmp/vsite python3 -m vllm.entrypoints.openai.api_server \
      --model $M --load-format dummy --max-model-len 8192 --port 18001 --served-model-name m \
      --generation-config vllm --seed 0 > "$OUT/vllm-serve.log" 2>&1 &
    measure vllm 18001 /health $!
  fi
  tar czf "$OUT/sweep-points.tgz" -C "$OUT" sweep  # the points lie deeper than the device tool brings back
fi
if has lora-tests; then
  # Needs peft, accelerate and psutil (and msgspec) in .whl: the GPU image has none of them.
  step "LoRA: parity with PEFT on CUDA (float32; CUDA graphs, chunked prefill, eager)"
  python3 -m pytest -q -p no:cacheprovider tests/gpu/test_lora_gpu.py 2>&1 | tail -15 | tee "$OUT/lora-pytest.txt" || status=1
fi
if has lora-bench; then
  # The same workload without --enable-lora, with it and no adapter used, and under adapters
  # (LORA_ADAPTERS of them, round robin, in LORA_SLOTS slots of rank LORA_RANK): one process each.
  step "LoRA: what adapters cost (Qwen3-0.6B shape, random weights, bf16)"
  for mode in base no-lora lora; do
    python3 -m benchmarks.lora_bench benchmarks/configs/qwen3-0.6b --mode $mode --max-loras "${LORA_SLOTS:-4}" \
      --rank "${LORA_RANK:-16}" --adapters "${LORA_ADAPTERS:-4}" --num-seqs 256 --min-input-len 100 \
      --max-input-len 1024 --min-output-len 100 --max-output-len 512 | grep '^RESULT\|^ROUND' \
      | tee -a "$OUT/lora.jsonl" || status=1
  done
fi
if has lora-vllm; then
  # vLLM 0.26.0's LoRA beside Pagoda's on the same workload, model and adapters (benchmarks/vllm_lora.py,
  # benchmarks/lora_bench.py), vLLM first, each mode in a process of its own. Needs the vLLM kit as for
  # `vllm` (a `vllm-stash` call right before) and .whl as for lora-bench.
  step "LoRA beside vLLM: modes ${LORA_MODES:-base lora}, ${LORA_ADAPTERS:-4} adapters of rank ${LORA_RANK:-16} in ${LORA_SLOTS:-4} slots"
  unpack_vllm || status=1
  LORA_ARGS=(--max-loras "${LORA_SLOTS:-4}" --rank "${LORA_RANK:-16}" --adapters "${LORA_ADAPTERS:-4}" --num-seqs 256
             --min-input-len 100 --max-input-len 1024 --min-output-len 100 --max-output-len 512)
  for mode in ${LORA_MODES:-base lora}; do
    PYTHONPATH=/tmp/vsite:$PYTHONPATH VLLM_NO_USAGE_STATS=1 timeout 300 python3 -m benchmarks.vllm_lora \
      benchmarks/configs/qwen3-0.6b --mode $mode "${LORA_ARGS[@]}" 2>&1 | grep -E '^RESULT|^ROUND|Error' \
      | tee -a "$OUT/lora-vllm.jsonl" || status=1
  done
  for mode in ${LORA_MODES:-base lora}; do
    python3 -m benchmarks.lora_bench benchmarks/configs/qwen3-0.6b --mode $mode "${LORA_ARGS[@]}" \
      | grep -E '^RESULT|^ROUND' | tee -a "$OUT/lora-vllm.jsonl" || status=1
  done
fi
if has api-compat; then
  # The Responses and Anthropic Messages APIs: the same requests to `pagoda serve` and then `vllm serve`
  # (0.26.0) on the Qwen3-0.6B shape (random weights, the word-level tokenizer with a small chat
  # template), each answer's status and JSON shape or streamed event order side by side
  # (benchmarks/api_compat.py). Needs the vLLM kit as for `vllm` (a `vllm-stash` call first), with
  # .vllm_b/sowhl (lm-format-enforcer, interegular) for vLLM's tool requests, and xgrammar in .whl.
  step "API shapes: /v1/responses and /v1/messages from pagoda serve, then vllm serve"
  unpack_vllm || status=1
  if [ -d .vllm_b/sowhl ] && [ ! -d /tmp/vsite/lmformatenforcer ]; then  # vLLM checks tool schemas with it
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vsite .vllm_b/sowhl/*.whl 2>&1 | grep -v -i warn
  fi
  q06_model
  cat > $M/chat_template.jinja <<'TEMPLATE'
{%- if tools %}<|tools|>{{ tools | tojson }}
{% endif %}{%- for m in messages %}<|{{ m['role'] }}|>{{ m['content'] if m['content'] is string else '' }}
{%- for c in m.get('tool_calls') or [] %}<call>{{ c['function']['name'] }} {{ c['function']['arguments'] | tojson }}</call>{% endfor %}
{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}
TEMPLATE
  rm -f "$OUT/api-compat.json"
  # (xgrammar from .whl: the tools and JSON-schema requests need a grammar backend; hermes: tool_choice auto)
  python3 -m pagoda_daemon serve $M --load-format dummy --max-model-len 4096 --port 18000 --served-model-name m \
    --device cuda --dtype bfloat16 --seed 0 --structured-outputs-backend xgrammar --tool-call-parser hermes \
    > "$OUT/pagoda-serve.log" 2>&1 &
  pid=$!
  if wait_ready 18000 /ready $pid; then
    python3 -m benchmarks.api_compat --server pagoda=http://127.0.0.1:18000 --model m --out "$OUT/api-compat.json" || status=1
  else status=1; tail -20 "$OUT/pagoda-serve.log"; fi
  kill -TERM $pid; wait $pid
  VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_USE_FLASHINFER_SAMPLER=0 TRANSFORMERS_OFFLINE=1 \
    PYTHONPATH=/tmp/vsite python3 -m vllm.entrypoints.openai.api_server \
    --model $M --load-format dummy --max-model-len 4096 --port 18001 --served-model-name m \
    --generation-config vllm --seed 0 --enable-auto-tool-choice --tool-call-parser hermes > "$OUT/vllm-serve.log" 2>&1 &
  pid=$!
  if wait_ready 18001 /health $pid; then
    python3 -m benchmarks.api_compat --server vllm=http://127.0.0.1:18001 --model m --out "$OUT/api-compat.json" \
      | tee "$OUT/api-compat.txt" || status=1
  else status=1; tail -20 "$OUT/vllm-serve.log"; fi
  kill -TERM $pid; wait $pid
fi
if has eplb; then
  # Issue #17: what EPLB costs at EP = 2 (2+ GPUs), Qwen3-30B-A3B shape, the nano-vllm workload, one
  # engine per run: off, moving at the rebalance, moving in the background (EPLB_ASYNC_STEPS), off
  # again; a rebalance every EPLB_INTERVAL steps with 2 redundant slots.
  step "EPLB at EP = 2: off, at the rebalance, in the background, off"
  A="--expert-parallel-size 2 --max-num-seqs 256"
  E="--eplb-step-interval ${EPLB_INTERVAL:-100} --num-redundant-experts 2"
  for run in off sync async off2; do
    case $run in off*) X="";; sync) X="$E";; async) X="$E --eplb-async-steps ${EPLB_ASYNC_STEPS:-4}";; esac
    timeout 200 python3 -m benchmarks.throughput $CFG/qwen3-30b-a3b $A $X --label "eplb-$run" 2>&1 \
      | grep '^RESULT' | tee -a "$OUT/eplb.jsonl" || status=1
  done
fi
if has dp; then
  # Issue #17: data parallelism. `pagoda serve --data-parallel-size N` (N engines, one GPU each, behind
  # one API server) for each of DP_SIZES, the same requests at once from `pagoda bench serve`
  # (DP_PROMPTS streamed token-id prompts of 103-921 tokens, 103-921 out); /health says where they
  # went. With the vLLM kit unpacked (a `vllm-stash` call first, .vllm_b carried, DP_VLLM=1), `vllm
  # serve --data-parallel-size N` after each model's Pagoda runs. DP_MODELS: configs under $CFG.
  # DP_PAGODA_ARGS / DP_VLLM_ARGS: more flags for runs with N > 1, e.g. the experts spread over the
  # engines: DP_MODELS=qwen3-30b-a3b DP_PAGODA_ARGS=--data-parallel-experts DP_VLLM_ARGS=--enable-expert-parallel.
  # DP_VLLM_SIZES: vLLM's sizes where they differ from DP_SIZES. Each line also records the client's
  # and the server's inter-token gaps and the CPU seconds the API server's process used for the run.
  step "data parallelism: pagoda serve --data-parallel-size ${DP_SIZES:-1 2}, same requests"
  [ -z "${DP_VLLM:-}" ] || unpack_vllm || status=1
  dp_bench() {  # LABEL PORT DP PID: the requests once the server is ready, then stop it
    if wait_ready "$2" "$5" "$4"; then
      cpu0=$(proc_cpu_s "$4")
      python3 -m pagoda_daemon bench serve --base-url "http://127.0.0.1:$2" --model m --vocab-size "$vocab" \
        --num-prompts "${DP_PROMPTS:-1024}" --input-len 512 --range-ratio 0.8 --output-len 512 --seed 0 --no-progress \
        --result-file "$OUT/dp-$1-$cfg-$3.json" > /dev/null || status=1
      export DP_API_CPU_S=$(python3 -c "print(round($(proc_cpu_s "$4") - $cpu0, 2))")
      curl -s "localhost:$2/health" > "$OUT/dp-$1-$cfg-$3-health.json"
      python3 - "$1" "$cfg" "$3" "$OUT/dp-$1-$cfg-$3.json" "$OUT/dp-$1-$cfg-$3-health.json" <<'PY' | tee -a "$OUT/dp.jsonl"
import json, os, sys
server, model, dp, result, health = sys.argv[1:]
r = json.load(open(result))
try:
    engines = json.load(open(health))["engine"].get("engines")
except (ValueError, KeyError):
    engines = None
print(json.dumps({"server": server, "model": model, "data_parallel_size": int(dp),
                  "args": (os.environ.get("DP_PAGODA_ARGS" if server == "pagoda" else "DP_VLLM_ARGS", "")
                           if int(dp) > 1 else ""), "completed": r["completed"],
                  "failed": r["failed"], "duration_s": r["duration_s"], "output_throughput": r["output_throughput"],
                  "total_token_throughput": r["total_token_throughput"], "ttft_ms_p50": r["ttft_ms"]["p50"],
                  "itl_ms": r["itl_ms"], "server_itl": (r.get("server_metrics") or {}).get("inter_token_latency"),
                  "api_process_cpu_s": float(os.environ["DP_API_CPU_S"]), "engines": engines}))
PY
    else status=1; tail -20 "$OUT/dp-$1-$cfg-$3.log"; fi
    kill -TERM "$4"; wait "$4"
  }
  proc_cpu_s() {  # PID: the CPU seconds (user + system) the process has used so far (its API server)
    awk -v hz="$(getconf CLK_TCK)" '{print ($14 + $15) / hz}' "/proc/$1/stat"
  }
  for cfg in ${DP_MODELS:-qwen3-0.6b llama3-8b}; do
    M=/tmp/dp-$cfg; mkdir -p $M && cp $CFG/$cfg/config.json $M/
    vocab=$(python3 -c "import json; print(json.load(open('$M/config.json'))['vocab_size'])")
    python3 -c "from benchmarks.throughput import save_word_level_tokenizer as s; s($vocab, '$M')" || status=1
    for dp in ${DP_SIZES:-1 2}; do
      python3 -m pagoda_daemon serve $M --load-format dummy --max-model-len 4096 --port 18000 --served-model-name m \
        --device cuda --dtype bfloat16 --seed 0 --data-parallel-size "$dp" $([ "$dp" -gt 1 ] && echo ${DP_PAGODA_ARGS:-}) \
        > "$OUT/dp-pagoda-$cfg-$dp.log" 2>&1 &
      dp_bench pagoda 18000 "$dp" $! /ready
    done
    if [ -n "${DP_VLLM:-}" ] && [ -f /tmp/vsite/vllm/__init__.py ]; then
      for dp in ${DP_VLLM_SIZES:-${DP_SIZES:-1 2}}; do
        VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_USE_FLASHINFER_SAMPLER=0 TRANSFORMERS_OFFLINE=1 \
          PYTHONPATH=/tmp/vsite python3 -m vllm.entrypoints.openai.api_server --model $M --load-format dummy \
          --max-model-len 4096 --port 18001 --served-model-name m --generation-config vllm --seed 0 \
          --data-parallel-size "$dp" $([ "$dp" -gt 1 ] && echo ${DP_VLLM_ARGS:-}) > "$OUT/dp-vllm-$cfg-$dp.log" 2>&1 &
        dp_bench vllm 18001 "$dp" $! /health
      done
    fi
  done
fi
if has pooling-tests; then
  # Needs msgspec in .whl (the GPU image has none).
  step "Embeddings and cross-encoders: parity with transformers on CUDA (float32; last, mean and first-token pooling; whole and chunked; pair scores)"
  python3 -m pytest -q -p no:cacheprovider tests/gpu/test_pooling_gpu.py 2>&1 | tail -15 | tee "$OUT/pooling-pytest.txt" || status=1
fi
if has embed-vllm; then
  # Embedding throughput, vLLM 0.26.0's LLM.embed (runner pooling) then Pagoda's engine, each in a
  # process of its own, on the same workloads (benchmarks/embed_bench.py, benchmarks/vllm_embed.py)
  # and the same model directory (the Qwen3-0.6B shape with a word-level tokenizer: vLLM's pooling
  # runner needs one). Needs the vLLM kit as for `vllm` (a `vllm-stash` call right before);
  # EMBED_NO_VLLM=1: Pagoda alone.
  # EMBED_MODEL=bge-base: the BERT encoder of bge-base-en-v1.5's shape (benchmarks/configs/bge-base,
  # [CLS] pooling, 512 positions) on the short and passages workloads instead.
  if [ "${EMBED_MODEL:-}" = bge-base ]; then
    M=/tmp/bge-base; mkdir -p $M && cp $CFG/bge-base/config.json $M/
    python3 -c "from benchmarks.throughput import save_word_level_tokenizer as s; s(30522, '$M')" || status=1
    embed_args=(--max-model-len 512 --workloads "${EMBED_WORKLOADS:-short,passages}")
  else
    q06_model
    embed_args=(--workloads "${EMBED_WORKLOADS:-short,long}")
  fi
  step "Embeddings beside vLLM: ${embed_args[*]} ($M, random weights, bf16)"
  if [ -z "${EMBED_NO_VLLM:-}" ]; then
    unpack_vllm || status=1
    PYTHONPATH=/tmp/vsite:$PYTHONPATH VLLM_NO_USAGE_STATS=1 timeout 400 python3 -m benchmarks.vllm_embed \
      $M "${embed_args[@]}" > "$OUT/embed-vllm.log" 2>&1 \
      || { status=1; grep -B12 -m1 Error "$OUT/embed-vllm.log"; }
    grep -E '^RESULT|^ROUND' "$OUT/embed-vllm.log" | tee -a "$OUT/embed.jsonl"
  fi
  python3 -m benchmarks.embed_bench $M "${embed_args[@]}" 2>&1 \
    | grep -E '^RESULT|^ROUND|Error' | tee -a "$OUT/embed.jsonl" || status=1
fi
# The rerank steps run the tokenizers library at its own default (parallel over the cores, as in a
# user's process), not at the TOKENIZERS_PARALLELISM=false this script sets for everything else;
# RERANK_TOKENIZERS_SERIAL=1 keeps it off. One tokenizer call for a batch of pairs (Pagoda's
# LLM.score) is parallel only then.
if [ -n "${RERANK_TOKENIZERS_SERIAL:-}" ]; then tokenizers_default=(env); tokenizers_label="tokenizers serial"
else tokenizers_default=(env -u TOKENIZERS_PARALLELISM); tokenizers_label="tokenizers at their default"; fi
if has rerank-vllm; then
  # Reranking throughput: vLLM 0.26.0's LLM.score then Pagoda's, each in a process of its own, on
  # bge-reranker-base's shape (XLM-RoBERTa cross-encoder, random weights, bf16) and the same
  # text pairs (benchmarks/rerank_bench.py). Needs the vLLM kit as for `vllm` (a `vllm-stash` call
  # right before); RERANK_NO_VLLM=1: Pagoda alone. RERANK_QWEN3=1: the original Qwen3-Reranker layout
  # on Qwen3-0.6B's shape instead (hf_overrides and the score template, rerank_bench --qwen3-reranker).
  if [ -n "${RERANK_QWEN3:-}" ]; then
    rerank_args=($CFG/qwen3-0.6b --qwen3-reranker); rerank_shape="Qwen3-Reranker-0.6B layout"
  else
    rerank_args=($CFG/bge-reranker-base); rerank_shape="bge-reranker-base shape"
  fi
  step "Reranking beside vLLM: ${RERANK_WORKLOADS:-passages,snippets} ($rerank_shape, random weights, bf16, ${tokenizers_label})"
  rerank_args+=(--workloads "${RERANK_WORKLOADS:-passages,snippets}")
  if [ -z "${RERANK_NO_VLLM:-}" ]; then
    unpack_vllm || status=1
    PYTHONPATH=/tmp/vsite:$PYTHONPATH "${tokenizers_default[@]}" timeout 260 python3 -m benchmarks.rerank_bench "${rerank_args[@]}" --engine vllm \
      > "$OUT/rerank-vllm.log" 2>&1 || { status=1; grep -B12 -m1 Error "$OUT/rerank-vllm.log"; }
    grep -E '^RESULT|^ROUND' "$OUT/rerank-vllm.log" | tee -a "$OUT/rerank.jsonl"
  fi
  "${tokenizers_default[@]}" timeout 200 python3 -m benchmarks.rerank_bench "${rerank_args[@]}" --engine pagoda \
    > "$OUT/rerank-pagoda.log" 2>&1 \
    || { status=1; tail -n 30 "$OUT/rerank-pagoda.log"; }
  grep -E '^RESULT|^ROUND' "$OUT/rerank-pagoda.log" | tee -a "$OUT/rerank.jsonl"
fi
if has rerank-serve; then
  # /v1/rerank of `pagoda serve` and then `vllm serve` (0.26.0), both serving the original
  # Qwen3-Reranker layout on Qwen3-0.6B's shape (random weights, the word-level tokenizer of
  # rerank_bench with "no" and "yes") through the same --hf-overrides and --chat-template, driven by
  # `pagoda bench sweep --endpoint rerank` over max_concurrency (RERANK_CONCURRENCY): RERANK_QUERIES
  # (256) queries a point, each with 16 documents of 70-394 words (a query of 8-32), fresh ones each
  # point. Needs the vLLM kit as for `vllm` (a `vllm-stash` call first); RERANK_NO_VLLM=1: Pagoda
  # alone. Pagoda's server takes fastapi, uvicorn, pydantic and pyzmq from the kit.
  step "Reranking served: pagoda serve, then vllm serve, concurrency ${RERANK_CONCURRENCY:-1,8,32,128} ($tokenizers_label)"
  [ -z "${RERANK_NO_VLLM:-}" ] && { unpack_vllm || status=1; }
  R=/tmp/rerank-served; mkdir -p $R && cp $CFG/qwen3-0.6b/config.json $R/
  python3 -c "from benchmarks.rerank_bench import save_pair_tokenizer as s; s(151936, '$R')" || status=1
  overrides=$(python3 -c "import json; from benchmarks.rerank_bench import QWEN3_RERANKER as o; print(json.dumps(o))")
  rerank_sweep() {  # LABEL=URL...
    local servers=(); for s in "$@"; do servers+=(--server "$s"); done
    PYTHONPATH=$PYTHONPATH:/tmp/vsite python3 -m pagoda_daemon bench sweep "${servers[@]}" --model m \
      --endpoint rerank --dataset random --vocab-size 151934 --decode-prompts-with $R \
      --num-prompts "${RERANK_QUERIES:-256}" --documents-per-query 16 --query-len 20 --input-len 232 \
      --range-ratio 0.6 --workload-var max_concurrency --values "${RERANK_CONCURRENCY:-1,8,32,128}" \
      --experiment-name rerank-serve --output-dir "$OUT/bench" --resume --no-progress 2>&1 | tail -8 || status=1
  }
  PYTHONPATH=$PYTHONPATH:/tmp/vsite "${tokenizers_default[@]}" python3 -m pagoda_daemon serve $R --load-format dummy --max-model-len 4096 \
    --port 18000 --served-model-name m --device cuda --dtype bfloat16 --seed 0 --hf-overrides "$overrides" \
    --chat-template examples/templates/qwen3_reranker.jinja > "$OUT/pagoda-rerank-serve.log" 2>&1 &
  pid=$!
  if wait_ready 18000 /ready $pid; then rerank_sweep pagoda=http://127.0.0.1:18000
  else status=1; tail -20 "$OUT/pagoda-rerank-serve.log"; fi
  kill -TERM $pid; wait $pid
  if [ -z "${RERANK_NO_VLLM:-}" ]; then
    VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_USE_FLASHINFER_SAMPLER=0 TRANSFORMERS_OFFLINE=1 \
      PYTHONPATH=/tmp/vsite "${tokenizers_default[@]}" python3 -m vllm.entrypoints.openai.api_server --model $R \
      --load-format dummy --max-model-len 4096 --port 18001 --served-model-name m --seed 0 --runner pooling \
      --hf-overrides "$overrides" --chat-template examples/templates/qwen3_reranker.jinja \
      > "$OUT/vllm-rerank-serve.log" 2>&1 &
    pid=$!
    if wait_ready 18001 /health $pid; then rerank_sweep vllm=http://127.0.0.1:18001
    else status=1; tail -20 "$OUT/vllm-rerank-serve.log"; fi
    kill -TERM $pid; wait $pid
  fi
  # every point (both servers', resumed: nothing is sent again) on one chart
  servers=(pagoda=http://127.0.0.1:18000); [ -z "${RERANK_NO_VLLM:-}" ] && servers+=(vllm=http://127.0.0.1:18001)
  rerank_sweep "${servers[@]}"
  # few files come back from the device: every point's summary in one JSONL, the chart, the logs in one archive
  python3 -c "import json, pathlib, sys; [print(json.dumps(json.loads(p.read_text()))) for p in
    sorted(pathlib.Path(sys.argv[1]).glob('*/*/iter-*.json'))]" "$OUT/bench/rerank-serve" > "$OUT/rerank-serve.jsonl"
  cp "$OUT"/bench/rerank-serve/throughput_vs_latency.png "$OUT/rerank-serve.png"
  cp "$OUT"/bench/rerank-serve/throughput_vs_latency.svg "$OUT/rerank-serve.svg"
  rm -rf "$OUT/bench/rerank-serve"
fi
if has rerank-rounds; then
  # Pagoda's offline LLM.score round after round on one engine (Qwen3-Reranker layout,
  # RERANK_ROUNDS rounds of the passages workload), each round's host time for its prompts apart
  # (prompts_s); then the same under cProfile, its stats in $OUT/rerank-rounds.pstats.
  step "Reranking round after round: ${RERANK_ROUNDS:-6} rounds of passages, Pagoda alone"
  timeout 240 python3 -m benchmarks.rerank_bench $CFG/qwen3-0.6b --qwen3-reranker --workloads passages \
    --rounds "${RERANK_ROUNDS:-6}" --engine pagoda 2>&1 | grep -E '^ROUND|Error' | tee -a "$OUT/rerank-rounds.jsonl"
  timeout 240 python3 -m cProfile -o "$OUT/rerank-rounds.pstats" -m benchmarks.rerank_bench $CFG/qwen3-0.6b \
    --qwen3-reranker --workloads passages --rounds 3 --engine pagoda 2>&1 | grep -E '^ROUND|Error' \
    | sed 's/^ROUND/PROFILED/' | tee -a "$OUT/rerank-rounds.jsonl"
fi
if has embed-serve; then
  # /v1/embeddings of `pagoda serve` and then `vllm serve` (0.26.0), both --runner pooling on the
  # Qwen3-0.6B shape (random weights, word-level tokenizer), driven by `pagoda bench sweep --endpoint
  # embeddings` over max_concurrency (EMBED_CONCURRENCY), EMBED_SERVE_PROMPTS (4,096) inputs of 16-256
  # tokens a point, fresh ones each point; each point's summary also copied to $OUT/embed-serve-*.json. Needs the vLLM kit as for `vllm` (a `vllm-stash` call first); Pagoda's server takes
  # fastapi, uvicorn, pydantic and pyzmq from it.
  step "Embeddings served: pagoda serve, then vllm serve, concurrency ${EMBED_CONCURRENCY:-1,16,64,256}"
  unpack_vllm || status=1
  q06_model
  embed_sweep() {  # PORT LABEL
    python3 -m pagoda_daemon bench sweep --server "$2=http://127.0.0.1:$1" --model m --endpoint embeddings \
      --dataset random --vocab-size 10000 --num-prompts "${EMBED_SERVE_PROMPTS:-4096}" --input-len 136 \
      --range-ratio 0.88 --workload-var max_concurrency --values "${EMBED_CONCURRENCY:-1,16,64,256}" \
      --experiment-name embed-serve --output-dir "$OUT/bench" --resume --no-progress 2>&1 | tail -8 || status=1
    for f in "$OUT"/bench/embed-serve/"$2"/*/iter-*.json; do  # <var>=<value>/iter-<n>.json
      d=$(basename "$(dirname "$f")"); cp "$f" "$OUT/embed-serve-$2-${d//=/-}-$(basename "$f")"; done
  }
  PYTHONPATH=$PYTHONPATH:/tmp/vsite python3 -m pagoda_daemon serve $M --load-format dummy --max-model-len 4096 \
    --port 18000 --served-model-name m --device cuda --dtype bfloat16 --seed 0 --runner pooling \
    > "$OUT/pagoda-embed-serve.log" 2>&1 &
  pid=$!
  if wait_ready 18000 /ready $pid; then PYTHONPATH=$PYTHONPATH:/tmp/vsite embed_sweep 18000 pagoda
  else status=1; tail -20 "$OUT/pagoda-embed-serve.log"; fi
  kill -TERM $pid; wait $pid
  VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_USE_FLASHINFER_SAMPLER=0 TRANSFORMERS_OFFLINE=1 \
    PYTHONPATH=/tmp/vsite python3 -m vllm.entrypoints.openai.api_server --model $M --load-format dummy \
    --max-model-len 4096 --port 18001 --served-model-name m --seed 0 --runner pooling \
    > "$OUT/vllm-embed-serve.log" 2>&1 &
  pid=$!
  if wait_ready 18001 /health $pid; then PYTHONPATH=$PYTHONPATH:/tmp/vsite embed_sweep 18001 vllm
  else status=1; tail -20 "$OUT/vllm-embed-serve.log"; fi
  kill -TERM $pid; wait $pid
  # both servers' points on one chart
  PYTHONPATH=$PYTHONPATH:/tmp/vsite python3 -m pagoda_daemon bench sweep --server pagoda=http://127.0.0.1:18000 \
    --server vllm=http://127.0.0.1:18001 --model m --endpoint embeddings --dataset random --vocab-size 10000 \
    --num-prompts "${EMBED_SERVE_PROMPTS:-4096}" --input-len 136 --range-ratio 0.88 --workload-var max_concurrency \
    --values "${EMBED_CONCURRENCY:-1,16,64,256}" --experiment-name embed-serve --output-dir "$OUT/bench" --resume \
    --no-progress 2>&1 | tail -3
fi
echo; echo "run_gpu.sh finished with status $status"
exit $status
