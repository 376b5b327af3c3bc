"""Data parallelism: `pagoda serve --data-parallel-size N` runs N engines, each with its own
scheduler, KV cache and ranks, behind one API server that sends each request to the engine with
the fewest in flight. On CPU, so that CI proves the routing, the stats, the KV events and the
failure handling; GPUs only change which device each engine takes (config.device_offset)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from pathlib import Path

import msgpack
import pytest
import torch
import zmq

from benchmarks.parity import random_prompts
from pagoda_daemon.config import EngineConfig
from pagoda_daemon.engine.messages import EngineStats, LoRAStats
from pagoda_daemon.server.engine_router import MIN_SLACK, EngineRouter, block_hashes
from pagoda_daemon.telemetry.kv_events import offset_endpoint
from tests.processes import warm_start_method


@pytest.mark.parametrize("options, message", [
    ({"data_parallel_size": 2, "data_parallel_rank": 2}, "data_parallel_rank 2 must be below data_parallel_size 2"),
    ({"data_parallel_size": 2, "tensor_parallel_size": 2, "nnodes": 2}, "runs its engines in one pod"),
    ({"data_parallel_size": 2, "tensor_parallel_size": 64}, "= 128 GPUs; at most 64"),
    ({"data_parallel_size": 2, "device": "cuda:1"}, "names one GPU"),
    ({"data_parallel_size": 2, "kv_transfer_port": 9000}, "prefill/decode disaggregation"),
    ({"data_parallel_size": 2, "expert_parallel_size": 2, "enable_eplb": True, "elastic_ep_min_size": 1,
      "elastic_ep_max_size": 2}, "elastic expert parallelism resizes one engine"),
    ({"data_parallel_experts": True}, "needs data_parallel_size 2 or more"),
    ({"data_parallel_size": 2, "data_parallel_experts": True, "tensor_parallel_size": 2}, "each engine on one GPU"),
    ({"data_parallel_size": 2, "all2all_backend": "alltoallv"}, "alltoallv .* it needs data_parallel_experts"),
    ({"data_parallel_size": 2, "data_parallel_experts": True, "all2all_backend": "deepep"}, "all2all_backend"),
    ({"data_parallel_size": 2, "data_parallel_experts": True, "all2all_backend": 3}, "all2all_backend"),
])
def test_what_data_parallelism_does_not_combine_with_is_refused(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="/m", **options)


def test_each_engine_takes_its_own_gpus_and_disk_tier():
    config = EngineConfig(model="/m", data_parallel_size=3, tensor_parallel_size=2, kv_offload_disk_path="/kv")
    engines = [config.for_data_parallel_rank(d) for d in range(3)]
    assert [e.device_offset for e in engines] == [0, 2, 4]
    assert [e.kv_offload_disk_path for e in engines] == ["/kv/dp0", "/kv/dp1", "/kv/dp2"]
    one = EngineConfig(model="/m", kv_offload_disk_path="/kv").for_data_parallel_rank(0)
    assert one.kv_offload_disk_path == "/kv" and one.device_offset == 0


def test_kv_events_of_each_engine_go_to_an_address_of_its_own():
    assert offset_endpoint("tcp://127.0.0.1:5557", 0) == "tcp://127.0.0.1:5557"
    assert offset_endpoint("tcp://127.0.0.1:5557", 3) == "tcp://127.0.0.1:5560"
    assert offset_endpoint("5557", 1) == "tcp://127.0.0.1:5558"
    assert offset_endpoint("ipc:///run/kv", 2) == "ipc:///run/kv_dp2"
    with pytest.raises(ValueError, match="above 65535"):
        offset_endpoint("tcp://127.0.0.1:65535", 1)


def test_the_engines_gauges_together_are_the_replicas():
    a = EngineStats(num_running=3, num_waiting=1, kv_cache_usage=0.5, num_kv_blocks=100, num_free_kv_blocks=50,
                    num_steps=7)
    b = EngineStats(num_running=2, num_waiting=0, kv_cache_usage=0.25, num_kv_blocks=300, num_free_kv_blocks=225)
    both = a.with_gauges_of([a, b])
    assert (both.num_running, both.num_waiting, both.num_kv_blocks, both.num_free_kv_blocks) == (5, 1, 400, 275)
    assert both.kv_cache_usage == pytest.approx((50 + 75) / 400) and both.num_steps == 7  # counters: a's own
    assert a.with_gauges_of([a]) is a
    assert both.lora is None
    a.lora, b.lora = LoRAStats(4, ["sql"], ["chat"]), LoRAStats(4, ["chat", "sql"], [])
    lora = a.with_gauges_of([a, b]).lora  # vllm:lora_requests_info: the adapters of any engine
    assert lora is not None and (lora.max_loras, lora.running, lora.waiting) == (4, ["chat", "sql"], ["chat"])


def test_a_conversation_stays_on_the_engine_that_holds_its_prefix():
    """The next turn goes where the turns before it went (their KV is cached there) while that
    engine is within the slack of the least loaded; beyond it, or without a shared prefix, to the
    least loaded; a different cache salt shares nothing; what an engine's cache cannot hold is
    forgotten, oldest first."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    turn1 = torch.randint(0, 1000, (70,), generator=g).tolist()
    turn2 = turn1 + torch.randint(0, 1000, (40,), generator=g).tolist()
    router = EngineRouter(2)
    assert block_hashes(turn2, 16)[:4] == block_hashes(turn1, 16) and len(block_hashes(turn2, 16)) == 6
    assert router.choose(block_hashes(turn1, 16), [0, 0], [0, 0]) == 0  # nothing shared: the least loaded
    assert router.choose(block_hashes(turn2, 16), [MIN_SLACK, 0], [1, 0]) == 0  # its prefix, within the slack
    assert router.choose(block_hashes(turn2, 16), [MIN_SLACK + 1, 0], [2, 0]) == 1  # beyond it
    assert router.choose(block_hashes(turn2, 16, ("salt", "b")), [0, 3], [3, 1]) == 0  # least loaded: 0
    other = torch.randint(0, 1000, (50,), generator=g).tolist()
    assert router.choose(block_hashes(other, 16, ("salt", "b")), [2, 2], [3, 1]) == 1  # a tie: the fewest so far
    router.set_capacity(0, 3)  # engine 0 keeps the last 3 blocks sent: turn1's first ones are gone
    assert router.choose(block_hashes(turn1, 16), [1, 0], [4, 2]) == 1
    assert router.choose(block_hashes([1, 2, 3], 16), [0, 0], [0, 0]) == 0  # no full block: least loaded


def test_pagoda_serve_with_two_engines(tiny_models, tmp_path):
    """Two engines behind one server: greedy answers equal the one-process engine's, requests
    go to both, /ready and /health show each, each engine publishes its KV events on its own
    port with its rank, every block comes back, and one engine killed fails the replica (500
    engine_dead, exit code 1, the other engine gone too) so the pod restarts as a whole."""
    import httpx

    from pagoda_daemon import LLM, SamplingParams
    from tests.server.conftest import ServerProcess, free_port

    port = free_port()
    while port >= 65535 or not _free(port + 1):
        port = free_port()
    path = tiny_models["llama"]
    srv = ServerProcess(path, "--max-model-len", "256", "--data-parallel-size", "2", "--dtype", "float32",
                        "--kv-events-endpoint", f"tcp://127.0.0.1:{port}", log_dir=tmp_path, served_name="tiny")
    ctx = zmq.Context()
    subs = []
    stopped, other = False, 0
    try:
        srv.wait_ready(timeout=180)
        for p in (port, port + 1):
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(f"tcp://127.0.0.1:{p}")
            subs.append(sub)
        ready = httpx.get(srv.url + "/ready").json()
        assert {p["engine"] for p in ready["startup"]} == {0, 1}
        # every prompt fills a block (16 tokens), so each engine has blocks to announce whichever it takes
        prompts = random_prompts(512, [19, 25, 30, 75, 21, 17, 40, 61], seed=int(torch.randint(0, 2**31, ()).item()))
        got: list = [None] * len(prompts)

        def ask(i: int) -> None:
            got[i] = httpx.post(srv.url + "/v1/completions", json={
                "model": "tiny", "prompt": prompts[i], "max_tokens": 8, "temperature": 0, "ignore_eos": True},
                timeout=60).json()["choices"][0]["text"]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        one = LLM(path, dtype="float32", device="cpu", max_model_len=256, num_kv_blocks=64)
        want = one.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        assert got == [w.outputs[0].text for w in want]
        engine = srv.wait_idle()  # the engines' blocks together: every one back
        assert [e["engine"] for e in engine["engines"]] == [0, 1]
        routed = [e["requests"] for e in engine["engines"]]
        assert sum(routed) == len(prompts) and min(routed) >= 2, routed  # at once, so both took some
        assert all(e["in_flight"] == 0 for e in engine["engines"])
        # a longer prompt on one of them goes to the engine that computed it, and finds its blocks
        base = prompts[-1] * 2
        before = srv.health().json()["engine"]
        for prompt in (base, base + prompts[0]):
            assert httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2},
                              timeout=60).status_code == 200
        after = srv.wait_idle()
        sent = [a["requests"] - b["requests"] for a, b in zip(after["engines"], before["engines"])]
        assert sorted(sent) == [0, 2], sent
        assert after["prefix_cache"]["hits"] - before["prefix_cache"]["hits"] >= len(base) // 16 * 16
        for rank, sub in enumerate(subs):  # each engine stored the blocks of its prompts, under its rank
            assert sub.poll(10_000), f"no KV events from engine {rank}"
            _, _, payload = sub.recv_multipart()
            assert msgpack.unpackb(payload)[2] == rank
        # One engine killed: the replica fails as a whole. The engine the next request goes to (no
        # full block: the one sent the fewest) is held stopped, so that request is still in flight
        # when the other's death is noticed.
        engines = srv.health().json()["engine"]["engines"]
        held = min(engines, key=lambda e: e["requests"])
        pids = _engine_pids(srv)  # in the order the server started them: engine 0, engine 1
        other, victim = pids[held["engine"]], pids[1 - held["engine"]]
        os.kill(other, signal.SIGSTOP)
        stopped = True
        replies: list = []
        thread = threading.Thread(target=lambda: replies.append(httpx.post(srv.url + "/v1/completions", json={
            "model": "tiny", "prompt": "hi", "max_tokens": 4}, timeout=60)))
        thread.start()
        deadline = time.monotonic() + 30
        while srv.health().json()["engine"]["engines"][held["engine"]]["in_flight"] == 0:
            assert time.monotonic() < deadline, "the request did not reach the held engine"
            time.sleep(0.05)
        os.kill(victim, signal.SIGKILL)
        thread.join(60)
        (reply,) = replies
        assert reply.status_code == 500 and reply.json()["error"]["code"] == "engine_dead", reply.text
        assert srv.proc.wait(30) == 1
        with contextlib.suppress(ProcessLookupError):  # the server killed it on its way out, or it ends now
            os.kill(other, signal.SIGCONT)
        stopped = False
        status = Path(f"/proc/{other}/status")
        deadline = time.monotonic() + 20
        while status.exists() and "zombie" not in status.read_text().lower():  # the other engine goes too
            assert time.monotonic() < deadline, "the other engine outlived the server"
            time.sleep(0.1)
    finally:
        if stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(other, signal.SIGCONT)
        for sub in subs:
            sub.close(0)
        ctx.term()
        srv.stop()


def test_experts_spread_over_the_engines_need_a_model_whose_experts_they_divide():
    from types import SimpleNamespace

    from pagoda_daemon.distributed.layout import check_layout

    moe = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                          moe_intermediate_size=32, intermediate_size=64)
    check_layout(moe, 1, 1, data_experts=4)
    with pytest.raises(ValueError, match=r"number of experts \(8\) is not divisible by data_parallel_size 3"):
        check_layout(moe, 1, 1, data_experts=3)
    dense = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        check_layout(dense, 1, 1, data_experts=2)


def test_pagoda_serve_with_the_experts_spread_over_two_engines(tiny_models, tmp_path):
    """Data-parallel attention: two engines each hold half of the experts and their own requests,
    and every MoE layer runs on both engines' tokens each step. Greedy answers equal the
    one-process engine's with every expert, whether both engines have requests (at once, with
    prompts split into chunks and requests preempted for KV blocks) or one runs alone while the
    other lends its experts on padding; every block comes back; the server leaves cleanly (the
    engines stop together, none waiting in a collective for the other)."""
    check_experts_spread_over_two_engines(tiny_models["qwen3_moe"], tmp_path, "cpu")


def _lockstep_engine(path: str, rank: int, rendezvous: str, prompts: list[list[int]], out: str,
                     extra: dict | None = None, device: str = "cpu") -> None:
    """One data-parallel engine core driven directly, with the GPU's step settings (async
    scheduling, eager steps padded to the token grid): its greedy tokens to `out`, and with
    EPLB (`extra`) its rebalances and the experts' placement of every MoE layer."""
    import json

    from pagoda_daemon.engine.engine_core import EngineCore
    from pagoda_daemon.engine.request import Request
    from pagoda_daemon.sampling_params import SamplingParams

    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    config = EngineConfig(model=path, device=device, dtype="float32", numa_policy="none", max_model_len=128,
                          max_num_batched_tokens=48, num_kv_blocks=10, async_scheduling=True, pad_eager_steps=True,
                          data_parallel_size=2, data_parallel_rank=rank, data_parallel_experts=True,
                          data_parallel_rendezvous=rendezvous, **(extra or {}))
    core = EngineCore(config)
    core.warm_up()
    lockstep = core.lockstep
    assert lockstep is not None
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(Request(f"r{i}", prompt, params, None, config.block_size))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    steps = 0
    while not lockstep.last.all_stopping:
        for o in core.step():
            tokens[o.request_id] += o.new_token_ids
        steps += 1
        lockstep.stopping = not core.has_unfinished_requests()
    balancer = core.executor.worker.balancer  # each engine's own
    reported = core.make_stats().balancer  # the replica's rebalances, reported by the first engine only
    balanced = {} if balancer is None else {"rebalances": balancer.rebalances, "slots_moved": balancer.slots_moved,
                                            "placements": [layer.placement for layer in balancer.layers],
                                            "reported": None if reported is None else reported.rebalances}
    core.shutdown()
    with open(out, "w") as f:
        json.dump({"tokens": [tokens[f"r{i}"] for i in range(len(prompts))], "steps": steps, **balanced}, f)


# EPLB every 3 steps with 2 redundant slots, the experts moved at the rebalance or in the background
SPREAD_EPLB = {"enable_eplb": True, "num_redundant_experts": 2, "eplb_step_interval": 3}
SPREAD_EPLB_ASYNC = {**SPREAD_EPLB, "eplb_async_steps": 1}


# the tokens sent by all-to-all to the engines holding their experts (token_dispatch.py), not gathered
SPREAD_EPLB_ALLTOALLV = {**SPREAD_EPLB, "all2all_backend": "alltoallv"}


@pytest.mark.parametrize("eplb", [None, SPREAD_EPLB, SPREAD_EPLB_ASYNC, SPREAD_EPLB_ALLTOALLV],
                         ids=["plain", "eplb", "eplb-async", "eplb-alltoallv"])
def test_engines_with_the_experts_spread_step_together_with_async_scheduling_and_padded_steps(tiny_models, tmp_path,
                                                                                               eplb):
    """Two engine cores in processes of their own, one with seven prompts (chunked, preempted) and
    one with a single short one that finishes early and then lends its experts on padding: with
    async scheduling and the padded token grid (a GPU's defaults) both produce the one-process
    engine's greedy tokens, and they stop together. With EPLB every 3 steps (2 redundant slots),
    the experts move between the engines while they serve, at the rebalance or in the background
    (each layer switching at a step the engines agree on), both engines ending on one placement;
    the same with each engine's real rows sent by all-to-all only to the engine holding their
    experts (an idle engine sending none) instead of every row gathered."""
    check_engines_step_together(tiny_models["qwen3_moe"], tmp_path, "cpu", eplb)


def check_engines_step_together(path: str, tmp_path: Path, device: str, eplb: dict | None) -> None:
    """The test above on `device` (tests/gpu/test_multi_gpu.py runs it on two GPUs: NCCL, CUDA
    graphs replayed by both engines, EPLB's moves between them)."""
    import json

    import torch.multiprocessing as mp

    from pagoda_daemon import LLM, SamplingParams

    prompts = random_prompts(512, [75, 9, 30, 61, 5, 90, 40, 12], seed=int(torch.randint(0, 2**31, ()).item()))
    split = [prompts[:7], prompts[7:]]
    ctx = mp.get_context(warm_start_method())
    procs = [ctx.Process(target=_lockstep_engine,
                         args=(path, d, str(tmp_path / "rdv"), split[d], str(tmp_path / f"{d}"), eplb, device))
             for d in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    assert [p.exitcode for p in procs] == [0, 0]
    results = [json.loads((tmp_path / f"{d}").read_text()) for d in range(2)]
    one = LLM(path, dtype="float32", device=device, max_model_len=128, num_kv_blocks=64)
    want = [o.outputs[0].token_ids for o in one.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))]
    assert results[0]["tokens"] + results[1]["tokens"] == [list(w) for w in want]
    assert results[0]["steps"] == results[1]["steps"]  # every agreement matched: the same number of calls
    if eplb:
        from pagoda_daemon.distributed.eplb import initial_placement

        assert results[0]["rebalances"] == results[1]["rebalances"] >= 3, results
        assert results[0]["placements"] == results[1]["placements"]
        assert any(p != initial_placement(8, 2, 5) for p in results[0]["placements"]), "no expert moved"
        assert results[0]["slots_moved"] == results[1]["slots_moved"] > 0
        # (stats since the engine's last ones, taken once after its warm-up)
        assert 0 < results[0]["reported"] <= results[0]["rebalances"] and results[1]["reported"] is None


def check_experts_spread_over_two_engines(path: str, tmp_path: Path, device: str) -> None:
    """The test above on `device` (tests/gpu/test_multi_gpu.py runs it on two GPUs, NCCL and
    CUDA graphs)."""
    import httpx

    from pagoda_daemon import LLM, SamplingParams
    from tests.server.conftest import ServerProcess

    limits = ["--max-model-len", "128", "--max-num-batched-tokens", "48", "--num-kv-blocks", "10"]
    srv = ServerProcess(path, *limits, "--data-parallel-size", "2", "--data-parallel-experts", "--dtype", "float32",
                        "--device", device, log_dir=tmp_path, served_name="tiny")
    try:
        srv.wait_ready(timeout=300)
        from tests.distributed.test_tensor_parallel import _listening_addresses

        for pid in _engine_pids(srv):  # the engines' gloo (and NCCL) sockets: loopback only
            listening = _listening_addresses(str(pid))
            assert listening and all(a in ("0100007F", "00000000000000000000000001000000") for a in listening), listening
        prompts = random_prompts(512, [3, 9, 30, 75, 5, 17, 40, 61, 90, 12],
                                 seed=int(torch.randint(0, 2**31, ()).item()))
        one = LLM(path, dtype="float32", device=device, max_model_len=128, num_kv_blocks=64)
        want = [w.outputs[0].text for w in one.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12,
                                                                                   ignore_eos=True))]
        del one

        def ask(prompt: str) -> str:
            reply = httpx.post(srv.url + "/v1/completions", json={
                "model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True},
                timeout=120)
            assert reply.status_code == 200, reply.text
            return reply.json()["choices"][0]["text"]

        assert ask(prompts[3]) == want[3]  # alone: the other engine runs its experts on padding
        # all at once, until a burst has preempted (requests that reach a busy machine one by one
        # may each find room: a full test run here once saw none in one burst)
        bursts = 0
        while bursts < 3:
            bursts += 1
            got: list = [None] * len(prompts)
            threads = [threading.Thread(target=lambda i=i, got=got: got.__setitem__(i, ask(prompts[i])))
                       for i in range(len(prompts))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert got == want
            engine = srv.wait_idle(timeout=60)
            metrics = httpx.get(srv.url + "/metrics").text
            preempted = [line for line in metrics.splitlines() if line.startswith("vllm:num_preemptions_total")]
            assert preempted, metrics
            if float(preempted[0].rsplit(" ", 1)[1]) > 0:
                break
        assert float(preempted[0].rsplit(" ", 1)[1]) > 0, preempted
        routed = [e["requests"] for e in engine["engines"]]
        assert sum(routed) == bursts * len(prompts) + 1 and min(routed) >= 2, routed
        assert 'pagoda:expert_parallel_size{model_name="tiny"} 2.0' in metrics  # the experts over both engines
    finally:
        code = srv.stop()
    log = srv.log_path.read_text()
    assert code == 0, log[-3000:]
    assert "engine failed" not in log, log[-3000:]  # engines leaving on request is no failure


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _engine_pids(srv) -> list[int]:
    """The server's engine-core processes (children started by multiprocessing's spawn), in the
    order they started (the 22nd field of /proc/PID/stat), which is the engines' order."""
    children = Path(f"/proc/{srv.proc.pid}/task/{srv.proc.pid}/children").read_text().split()
    pids = [int(pid) for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    return sorted(pids, key=lambda pid: (int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]), pid))
