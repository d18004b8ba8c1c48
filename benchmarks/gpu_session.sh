#!/usr/bin/env bash
# One device call: GPU tests of the engine, then the offline LoRA-vs-base run on
# the Llama-3-8B shape with 32 rank-16 adapters. Writes logs and JSON to $OUT.
# Usage (device tool, carry .devwheels): bash benchmarks/gpu_session.sh
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devwheels/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 LORASERVE_NO_PROGRESS=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/machine.txt"
timeout "${TEST_TIMEOUT:-180}" python3 -m pytest -q tests/test_engine_gpu.py \
    tests/test_paged_attention_gpu.py \
    > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?" >> "$OUT/gpu_tests.log"
python3 benchmarks/make_bench_setup.py --out /tmp/bench --num-adapters "${NUM_ADAPTERS:-32}" \
    --rank 16 > "$OUT/setup.log" 2>&1
if [ "${RUN_LORA:-1}" = 1 ]; then
  timeout "${BENCH_TIMEOUT:-300}" python3 benchmarks/offline.py \
      --model /tmp/bench/llama3-8b-shape --load-format dummy --adapters /tmp/bench/adapters \
      --num-adapters 32 --num-requests 256 --input-len 512 --output-len 128 \
      --json "$OUT/offline.json" > "$OUT/offline.log" 2>&1
  echo "offline rc=$?" >> "$OUT/offline.log"
fi
# Decode speed of the base model at batch 32 (short prompts, long outputs).
timeout "${BENCH_TIMEOUT:-300}" python3 benchmarks/offline.py \
    --model /tmp/bench/llama3-8b-shape --load-format dummy --num-requests 32 \
    --max-num-seqs 32 --input-len 64 --output-len 512 \
    --json "$OUT/decode32.json" > "$OUT/decode32.log" 2>&1
echo "decode32 rc=$?" >> "$OUT/decode32.log"
tail -n 5 "$OUT"/*.log
