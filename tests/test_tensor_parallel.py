"""Tensor parallelism on the CPU (gloo, 2 processes): greedy tokens equal one
rank's and transformers+PEFT's (fp32) with mixed adapters, with and without
fully sharded LoRA; seeded sampling is the same too; bad sizes are refused at
start-up; `loraserve serve -tp 2` answers; a rank 0 stuck after a rank died is
ended by its watchdog, and a normal stop is not taken for a death. (A rank killed
under a live server: test_faults.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from utils import ALL_TARGETS, hf_greedy, make_peft_adapter, make_tiny_model

from loraserve import LLM, LoRARequest, SamplingParams

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def tp_adapters(tmp_path_factory, llama_dir) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp_adapters")
    return {
        "all": make_peft_adapter(llama_dir, root / "all", r=8, alpha=16, seed=31, scale=0.3,
                                 target_modules=("embed_tokens", "lm_head", *ALL_TARGETS)),
        "qv": make_peft_adapter(llama_dir, root / "qv", r=16, alpha=8, seed=32, scale=0.3,
                                target_modules=("q_proj", "v_proj")),
        "mlp": make_peft_adapter(llama_dir, root / "mlp", r=1, alpha=2, seed=33, scale=0.6,
                                 target_modules=("gate_proj", "up_proj", "down_proj", "o_proj")),
    }


def _run(model_dir, prompts, loras, params=GREEDY, **engine) -> list[list[int]]:
    # Two gloo processes on the CPU, on any machine (the GPU test asks for cuda).
    llm = LLM(model_dir, **{"device": "cpu", **engine})
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, loras)
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.shutdown()


def _batch(prompts, adapters):
    loras = [None] + [LoRARequest(n, i + 1, p) for i, (n, p) in enumerate(adapters.items())]
    return [(p, lora) for p in prompts for lora in loras]


@pytest.mark.parametrize("fully_sharded", [False, True])
def test_tp2_matches_tp1_and_peft(llama_dir, tp_adapters, prompts, fully_sharded):
    """Four adapter slots for three adapters and the base model, two at a time:
    slots are rewritten between steps on every rank."""
    batch = _batch(prompts[:2], tp_adapters)
    engine = dict(enable_lora=True, max_lora_rank=16, max_loras=2)
    ids, loras = [p for p, _ in batch], [lora for _, lora in batch]
    got = _run(llama_dir, ids, loras, tensor_parallel_size=2,
               fully_sharded_loras=fully_sharded, **engine)
    assert got == _run(llama_dir, ids, loras, **engine)
    for (p, lora), tokens in zip(batch, got, strict=True):
        assert tokens == hf_greedy(llama_dir, lora.lora_path if lora else None, p, MAX_TOKENS)


def test_replicated_kv_heads_and_chunked_prefill(tmp_path, prompts):
    """One KV head for two ranks (each holds a copy), QKV biases, and prompts split
    over steps by a small token budget."""
    model_dir = make_tiny_model(tmp_path / "m", "qwen2", num_kv_heads=1, seed=4)
    adapter = make_peft_adapter(model_dir, tmp_path / "a", r=8, alpha=16, seed=5, scale=0.3)
    lora = LoRARequest("a", 1, adapter)
    got = _run(model_dir, prompts, [lora, None, lora, None], tensor_parallel_size=2,
               enable_lora=True, max_lora_rank=8, fully_sharded_loras=True,
               max_num_batched_tokens=6)
    for p, lora_req, tokens in zip(prompts, [lora, None, lora, None], got, strict=True):
        want = hf_greedy(model_dir, lora_req.lora_path if lora_req else None, p, MAX_TOKENS)
        assert tokens == want


def test_seeded_sampling_matches_tp1(llama_dir, tp_adapters, prompts):
    """Only rank 0 samples; the other rank must take its tokens for the next step."""
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=MAX_TOKENS, seed=7,
                            ignore_eos=True)
    batch = _batch(prompts[2:], {"all": tp_adapters["all"]})
    ids, loras = [p for p, _ in batch], [lora for _, lora in batch]
    engine = dict(enable_lora=True, max_lora_rank=8, max_loras=1)
    assert (_run(llama_dir, ids, loras, params, tensor_parallel_size=2, **engine)
            == _run(llama_dir, ids, loras, params, **engine))


def test_structured_outputs_match_tp1(llama_dir, tp_adapters, prompts):
    """Grammar rows are sampled by rank 0 after the step is launched; the other rank
    takes their tokens for the next step like any other."""
    import re

    from transformers import AutoTokenizer

    from loraserve.structured_output.params import StructuredOutputsParams

    params = SamplingParams(temperature=0.0, max_tokens=24,
                            structured_outputs=StructuredOutputsParams(regex="[a-z]{3,20}"))
    batch = _batch(prompts[:2], {"qv": tp_adapters["qv"]})
    ids, loras = [p for p, _ in batch], [lora for _, lora in batch]
    engine = dict(enable_lora=True, max_lora_rank=16, max_loras=1)
    got = _run(llama_dir, ids, loras, params, tensor_parallel_size=2, **engine)
    assert got == _run(llama_dir, ids, loras, params, **engine)
    tok = AutoTokenizer.from_pretrained(llama_dir)
    for tokens in got:
        assert re.fullmatch("[a-z]{3,20}", tok.decode(tokens, skip_special_tokens=True))


@pytest.mark.parametrize("engine,message", [
    (dict(tensor_parallel_size=3), "does not divide the model's num_attention_heads 4"),
    (dict(tensor_parallel_size=0), "must be a positive integer"),
    (dict(tensor_parallel_size=2, enable_lora=True, max_lora_rank=1,
          fully_sharded_loras=True), "max_lora_rank 1 is not a multiple"),
    (dict(tensor_parallel_size=2, fully_sharded_loras=True), "without enable_lora"),
])
def test_bad_sizes_are_refused_at_start_up(llama_dir, engine, message):
    with pytest.raises(ValueError, match=message):
        LLM(llama_dir, device="cpu", **engine)


def test_serve_with_two_ranks(llama_dir, tp_adapters, prompts):
    from serve_utils import ServerProcess
    from transformers import AutoTokenizer

    adapter = tp_adapters["all"]
    server = ServerProcess([llama_dir, "--device", "cpu", "--tensor-parallel-size", "2",
                            "--enable-lora", "--max-lora-rank", "8",
                            "--lora-modules", f"all={adapter}"])
    try:
        # The API server, the engine core (rank 0) and the other rank.
        assert len(server._all_pids) >= 3
        tok = AutoTokenizer.from_pretrained(llama_dir)
        for model, path in (("all", adapter), (llama_dir, None)):
            body = server.post("/v1/completions", json={
                "model": model, "prompt": prompts[1], "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True,
            })
            assert body.status_code == 200, body.text
            want = tok.decode(hf_greedy(llama_dir, path, prompts[1], MAX_TOKENS),
                              skip_special_tokens=True)
            assert body.json()["choices"][0]["text"] == want
    finally:
        server.stop()
    assert server.all_gone()


# Rank 0 with one real worker process; its main thread sleeps where a collective
# that never returns would hang (NCCL does not notice a dead peer).
_WATCHED_RANK_0 = textwrap.dedent("""
    import multiprocessing, sys, time
    from loraserve.distributed.parallel_state import SINGLE
    from loraserve.engine import core_proc
    from loraserve.executor.tensor_parallel import RankProcesses

    if __name__ == "__main__":
        core_proc._RANK_DEATH_GRACE_S = 0.5
        stop = sys.argv[1] == "stop"
        worker = multiprocessing.get_context("spawn").Process(
            target=time.sleep, args=(1 if stop else 120,))
        worker.start()
        group = RankProcesses(SINGLE, [worker])
        core_proc.watch_ranks(group)
        print(worker.pid, flush=True)
        if stop:
            group.shutdown()
        time.sleep(3 if stop else 120)
        print("still here", flush=True)
""")


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_watchdog_ends_rank_0_stuck_after_a_rank_died(tmp_path, how):
    script = tmp_path / "rank0.py"
    script.write_text(_WATCHED_RANK_0)
    proc = subprocess.Popen([sys.executable, str(script), how], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        worker = int(proc.stdout.readline())
        if how == "kill":
            os.kill(worker, signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    if how == "kill":
        assert proc.returncode == 1, (out, err)
        assert "still here" not in out
        assert f"tensor-parallel rank 1 (pid {worker}) died: killed by SIGKILL" in err, err
    else:
        # The worker left because it was told to: the process goes on.
        assert proc.returncode == 0, (out, err)
        assert "still here" in out and "died" not in err, (out, err)


@pytest.mark.gpu
def test_gpu_tp2_matches_tp1(llama_dir, tp_adapters, prompts):
    """NCCL on two GPUs, with CUDA graphs for decode steps; fp32 so both equal PEFT."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    batch = _batch(prompts, tp_adapters)
    ids, loras = [p for p, _ in batch], [lora for _, lora in batch]
    engine = dict(device="cuda", dtype="float32", enable_lora=True, max_lora_rank=16,
                  max_loras=4, max_num_seqs=16, kv_cache_memory_bytes=1 << 28)
    want = _run(llama_dir, ids, loras, **engine)
    for fully_sharded in (False, True):
        # Eager, decode graphs, and piecewise graphs for the other steps (every rank
        # must pick the same path, or their collectives would not match).
        for mode in ("NONE", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"):
            got = _run(llama_dir, ids, loras, tensor_parallel_size=2,
                       fully_sharded_loras=fully_sharded, cudagraph_mode=mode, **engine)
            assert got == want, (fully_sharded, mode)
    for (p, lora), tokens in zip(batch, want, strict=True):
        assert tokens == hf_greedy(llama_dir, lora.lora_path if lora else None, p, MAX_TOKENS)
