#!/usr/bin/env bash
# One device call: GPU tests of the engine, then the offline LoRA-vs-base run on
# the Llama-3-8B shape with 32 rank-16 adapters. Writes logs and JSON to $OUT.
# Usage (device tool, carry .devwheels): bash benchmarks/gpu_session.sh
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devwheels/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 LORASERVE_NO_PROGRESS=1
pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/machine.txt"
timeout "${TEST_TIMEOUT:-180}" python -m pytest -q -x tests/test_engine_gpu.py \
    > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?" >> "$OUT/gpu_tests.log"
python benchmarks/make_bench_setup.py --out /tmp/bench --num-adapters 32 --rank 16 \
    > "$OUT/setup.log" 2>&1
timeout "${BENCH_TIMEOUT:-300}" python benchmarks/offline.py \
    --model /tmp/bench/llama3-8b-shape --load-format dummy --adapters /tmp/bench/adapters \
    --num-adapters 32 --num-requests 256 --input-len 512 --output-len 128 \
    --json "$OUT/offline.json" > "$OUT/offline.log" 2>&1
echo "offline rc=$?" >> "$OUT/offline.log"
tail -5 "$OUT/gpu_tests.log" "$OUT/offline.log"
