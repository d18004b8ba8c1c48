#!/usr/bin/env bash
# Runs the GPU tests and the benchmarks of benchmarks/RESULTS.md on a CUDA machine, on the
# Llama-3-8B shape with dummy weights (no download). Run from the repository root:
#
#   STAGES="tests offline decode32" bash benchmarks/gpu_suite.sh
#
# Every stage writes its log and JSON under RESULTS_DIR (default gpu_results/). Settings:
#   STAGES       the stages to run, from the list below (default "tests offline decode32");
#                they run in the order listed here, whatever the order in STAGES
#   RESULTS_DIR  where the results go (default gpu_results)
#   ARCHIVE      also pack RESULTS_DIR into this .tgz at the end (e.g. for a machine that
#                hands back only a few files)
#   WHEELS       a folder of wheels to install first into a private site folder, for a
#                machine without network access (e.g. WHEELS=.devwheels)
# Stages (each runs modules of the benchmarks package with `python3 -m`, from the
# repository root; the files named below are under benchmarks/):
#   tune      tune LoRA kernel configs (kernels/tune_kernels.py; TUNE_CLASSES, TUNE_TOKENS)
#             into the table
#   dense     tune the decode GEMM against cuBLAS (kernels/tune_dense.py, DENSE_TOKENS,
#             DENSE_BUDGET) into the table
#   tests     the GPU tests (after tune: they run on the table it wrote; TEST_FILES)
#   layer     LoRA cost per linear layer class (kernels/lora_layer.py)
#   moe       MoE grouped GEMM and MoE LoRA vs the torch path on Mixtral-8x7B layer shapes
#             (kernels/moe_lora.py)
#   tp        offline base and LoRA throughput at tensor-parallel sizes 1 and 2, with and
#             without --fully-sharded-loras (tensor_parallel.py; needs 2 GPUs)
#   attention decode attention alone, tilings and split counts side by side
#             (kernels/attention.py --sweep; ATTN_ARGS, e.g. "--batches 1 4 --splits 8 16 32")
#   profile   where a batch-32 decode step's time goes (profile/decode.py)
#   decode32  base decode at batch 32 (offline.py --decode-rate; DECODE_REPEATS runs, the
#             median), and the same through transformers (PEFT=1, the default)
#   timeline  where the batch-32 decode run's wall time goes: host, prefill, decode steps,
#             device idle between them (profile/timeline.py)
#   offprof   where the offline run's LoRA overhead goes: prefill vs decode, GPU time by
#             kernel kind (profile/offline.py)
#   offline   LoRA vs base offline throughput, 32 rank-16 adapters, 256 requests
#             (OFFLINE_REPEATS alternating base/LoRA runs in one process, default 3;
#             OFFLINE_RUNS whole runs, each in a fresh process)
#   startup   graph capture time and memory, LoRA vs base (startup.py; PROFILE_STARTUP=1
#             adds a cProfile of each start, which slows the host side)
#   firstuse  the Triton compiles on requests' paths after start-up, LoRA engine as served
#             (profile/first_use.py)
#   serve     one LoRA server (32 adapters, --max-loras 32) under continuous load from
#             serve/, the load generator: alternating base and LoRA phases at
#             concurrency 4 (ITL at low load), 16 and 64 and at a Poisson rate (RATE,
#             default 16/s); input 128-1024, output 64-256 tokens (SERVE_BENCHES picks
#             some by name, SERVER_ARGS adds server flags); once per mode of GRAPH_MODES
#   structured  a base server (--max-num-seqs 64, on a byte-level tokenizer that can write
#             JSON) under serve/'s load at concurrency 32, input 128-512, output 128:
#             alternating plain phases and phases where STRUCT_FRACTIONS of the requests
#             (default "0.03125 0.25": 1 in 32, then 1 in 4; one run each) carry a JSON
#             schema; the TPOT of constrained and of unconstrained requests against the
#             plain phases' (STRUCT_REQUESTS per phase, default 256; STRUCT_PHASES, default
#             plain,schema,plain,schema; STRUCT_TIMEOUT a run, default 90 s; about 3
#             minutes in all with the server's start; STRUCT_SERVER_ARGS adds server
#             flags), rows in structured.md
#   steps     base against LoRA per kind of step: host, wall and GPU kernel time of decode
#             steps and of decode plus a prefill chunk (profile/steps.py; STEPS_ARGS);
#             once per mode of GRAPH_MODES
#   many      many adapters per GPU: one server per setting under serve/'s load, every run
#             a row with its commands in many.md (many_adapters.sh, whose head lists the runs
#             and their settings: MANY_RUNS picks some of them, to split the stage over calls)
set -uo pipefail
OUT=${RESULTS_DIR:-gpu_results}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
pack() { if [ -n "${ARCHIVE:-}" ]; then tar czf "$ARCHIVE" -C "$OUT" .; fi; }
trap pack EXIT
STAGES=${STAGES:-"tests offline decode32"}
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHEELS"/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 LORASERVE_NO_PROGRESS=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/machine.txt"
MODEL=/tmp/bench/llama3-8b-shape
ADAPTERS=/tmp/bench/adapters
has() { [[ " $STAGES " == *" $1 "* ]]; }
stamp() { echo "$(date +%T) $*" >> "$OUT/stages.log"; }

if has tune; then
  # Tune the LoRA launch configs of the named classes and T buckets into the
  # table the kernels read (kept entries: --merge), before the benchmarks run.
  stamp tune
  timeout "${TUNE_TIMEOUT:-150}" python3 -m benchmarks.kernels.tune_kernels --merge \
      --out loraserve/kernels/configs/NVIDIA_H200.json --classes ${TUNE_CLASSES:-gate_up down} \
      --tokens ${TUNE_TOKENS:-256 1024 4096} --ranks 16 --budget-s "${TUNE_BUDGET:-110}" ${TUNE_ARGS:-} \
      > "$OUT/tune.log" 2>&1
  echo "tune rc=$?" >> "$OUT/tune.log"
  cp loraserve/kernels/configs/NVIDIA_H200.json "$OUT/NVIDIA_H200.json"
fi

if has dense; then
  stamp dense
  timeout "${DENSE_TIMEOUT:-300}" python3 -m benchmarks.kernels.tune_dense --merge \
      --out loraserve/kernels/configs/NVIDIA_H200.json --tokens ${DENSE_TOKENS:-32 16 64} \
      --budget-s "${DENSE_BUDGET:-200}" --json "$OUT/dense.json" --md "$OUT/dense.md" \
      > "$OUT/dense.log" 2>&1
  echo "dense rc=$?" >> "$OUT/dense.log"
  cp loraserve/kernels/configs/NVIDIA_H200.json "$OUT/NVIDIA_H200.json"
fi

if has tests; then
  stamp tests
  # The gpu-marked tests, and the fused-kernel tests that run compiled on a GPU.
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q ${TEST_FILES:-tests/test_engine_gpu.py \
      tests/test_kernels_gpu.py tests/test_dense_gemm_gpu.py tests/test_paged_attention_gpu.py \
      tests/test_sampler_gpu.py tests/test_argmax.py \
      tests/test_fused_norm_rope.py tests/test_moe_gpu.py tests/test_moe_kernels.py \
      tests/test_piecewise_graphs.py tests/test_embedding_lora.py tests/test_tensor_parallel.py} \
      > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests rc=$?" >> "$OUT/gpu_tests.log"
fi

if has layer; then
  # What LoRA adds to each linear layer class.
  stamp layer
  timeout "${BENCH_TIMEOUT:-300}" python3 -m benchmarks.kernels.lora_layer --json "$OUT/lora_layer.json" ${LAYER_ARGS:-} \
      > "$OUT/lora_layer.log" 2>&1
  echo "layer rc=$?" >> "$OUT/lora_layer.log"
fi

if has moe; then
  stamp moe
  timeout "${BENCH_TIMEOUT:-300}" python3 -m benchmarks.kernels.moe_lora > "$OUT/moe_lora.md" 2>&1
  echo "moe rc=$?" >> "$OUT/moe_lora.md"
fi

if has attention; then
  stamp attention
  timeout "${BENCH_TIMEOUT:-300}" python3 -m benchmarks.kernels.attention --sweep --no-prefill \
      ${ATTN_ARGS:-} --json "$OUT/attention.json" --md "$OUT/attention.md" \
      > "$OUT/attention.log" 2>&1
  echo "attention rc=$?" >> "$OUT/attention.log"
fi

if has profile || has decode32 || has timeline || has offprof || has offline || has startup || has firstuse || has serve || has steps || has tp || has many; then
  stamp setup
  # The offline runs repeat their prompts, so they turn the prefix cache off (it would
  # serve the repeats); benchmarks.serve gives every phase prompts of its own.
  python3 -m benchmarks.make_bench_setup --out /tmp/bench --num-adapters "${NUM_ADAPTERS:-32}" \
      --rank 16 > "$OUT/setup.log" 2>&1
fi

if has profile; then
  stamp profile
  timeout "${BENCH_TIMEOUT:-300}" python3 -m benchmarks.profile.decode --model $MODEL \
      --load-format dummy --batch 32 --out "$OUT/profile" > "$OUT/profile.log" 2>&1
  echo "profile rc=$?" >> "$OUT/profile.log"
fi

if has decode32; then
  stamp decode32
  # Short prompts, long outputs: nearly every step is a batch-32 decode.
  timeout "${BENCH_TIMEOUT:-300}" python3 -m benchmarks.offline \
      --model $MODEL --load-format dummy --num-requests 32 \
      --max-num-seqs 32 --input-len 64 --output-len 512 --decode-rate \
      --repeats "${DECODE_REPEATS:-1}" \
      --json "$OUT/decode32.json" > "$OUT/decode32.log" 2>&1
  echo "decode32 rc=$?" >> "$OUT/decode32.log"
  if [ "${PEFT:-1}" = 1 ]; then
    timeout "${BENCH_TIMEOUT:-300}" python3 -m benchmarks.peft_baseline --model $MODEL \
        --num-requests 32 --batch-size 32 --input-len 64 --output-len 512 --no-lora \
        --json "$OUT/decode32_peft.json" > "$OUT/decode32_peft.log" 2>&1
    echo "decode32 peft rc=$?" >> "$OUT/decode32_peft.log"
  fi
fi

if has timeline; then
  stamp timeline
  timeout "${BENCH_TIMEOUT:-300}" python3 -m benchmarks.profile.timeline --model $MODEL \
      --load-format dummy --json "$OUT/timeline.json" > "$OUT/timeline.log" 2>&1
  echo "timeline rc=$?" >> "$OUT/timeline.log"
fi

if has offprof; then
  stamp offprof
  timeout "${BENCH_TIMEOUT:-300}" python3 -m benchmarks.profile.offline --model $MODEL \
      --load-format dummy --adapters $ADAPTERS --out "$OUT/offprof" > "$OUT/offprof.log" 2>&1
  echo "offprof rc=$?" >> "$OUT/offprof.log"
fi

if has offline; then
  for i in $(seq "${OFFLINE_RUNS:-1}"); do
    stamp "offline $i"
    suffix=$([ "$i" = 1 ] && echo "" || echo "_$i")
    timeout "${BENCH_TIMEOUT:-300}" python3 -m benchmarks.offline \
        --model $MODEL --load-format dummy --adapters $ADAPTERS \
        --num-adapters 32 --num-requests 256 --input-len 512 --output-len 128 \
        --repeats "${OFFLINE_REPEATS:-3}" \
        --json "$OUT/offline$suffix.json" > "$OUT/offline$suffix.log" 2>&1
    echo "offline rc=$?" >> "$OUT/offline$suffix.log"
  done
fi

if has startup; then
  stamp startup
  timeout "${BENCH_TIMEOUT:-300}" python3 -m benchmarks.startup --model $MODEL \
      --load-format dummy --max-loras 8 --max-num-seqs 256 \
      ${PROFILE_STARTUP:+--profile-dir "$OUT/startup_profile"} \
      --json "$OUT/startup.json" > "$OUT/startup.log" 2>&1
  echo "startup rc=$?" >> "$OUT/startup.log"
fi

if has firstuse; then
  stamp firstuse
  timeout "${BENCH_TIMEOUT:-300}" python3 -m benchmarks.profile.first_use --model $MODEL \
      --load-format dummy --adapters $ADAPTERS --json "$OUT/first_use.json" \
      > "$OUT/first_use.log" 2>&1
  echo "firstuse rc=$?" >> "$OUT/first_use.log"
fi

if has tp; then
  for sharding in "" --fully-sharded-loras; do
    name=tp${sharding:+_fully_sharded}
    stamp "$name"
    timeout "${BENCH_TIMEOUT:-600}" python3 -m benchmarks.tensor_parallel \
        --model $MODEL --load-format dummy --adapters $ADAPTERS --sizes 1 2 \
        --num-requests 256 --input-len 512 --output-len 128 $sharding \
        --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
    echo "$name rc=$?" >> "$OUT/$name.log"
  done
fi

# serve and steps run once per CUDA graph mode in GRAPH_MODES, their files suffixed
# with the mode, so that one run compares the modes.
GRAPH_MODES=${GRAPH_MODES:-"FULL_DECODE_ONLY FULL_AND_PIECEWISE"}

if has serve; then
  # Continuous load on one LoRA server: base and LoRA phases alternate, so that both see
  # the same server in the same state. Variable lengths, 32 adapters in 32 slots.
  mods=()
  for d in "$ADAPTERS"/*/; do n=$(basename "$d"); mods+=("$n=$d"); done
  for mode in $GRAPH_MODES; do
    stamp "serve $mode"
    python3 -m loraserve.cli serve $MODEL --load-format dummy --enable-lora --max-loras 32 \
        --max-lora-rank 16 --max-cpu-loras 32 --port 8011 --lora-modules "${mods[@]}" \
        --cudagraph-mode "$mode" ${SERVER_ARGS:-} > "$OUT/server_$mode.log" 2>&1 &
    server=$!
    for _ in $(seq 300); do
      curl -sf http://127.0.0.1:8011/v1/models > /dev/null && break; sleep 1
    done
    bench() {  # name, then benchmarks.serve's arguments; SERVE_BENCHES picks some of the names
      local name=$1; shift
      [ -n "${SERVE_BENCHES:-}" ] && [[ " $SERVE_BENCHES " != *" $name "* ]] && return
      stamp "serve $mode $name"
      timeout "${SERVE_TIMEOUT:-240}" python3 -m benchmarks.serve http://127.0.0.1:8011 \
          --phases "${PHASES:-base,lora,base,lora}" --num-clients 4 \
          --json "$OUT/serve_${name}_$mode.json" "$@" > "$OUT/serve_${name}_$mode.log" 2>&1
      echo "rc=$?" >> "$OUT/serve_${name}_$mode.log"
    }
    bench c4 --num-requests 32 --max-concurrency 4 --input-len 512 \
        --output-len 128 --warmup-requests 4
    bench c16 --num-requests 256 --max-concurrency 16 --input-len 128:1024 \
        --output-len 64:256
    bench c64 --num-requests 256 --max-concurrency 64 --input-len 128:1024 \
        --output-len 64:256
    bench poisson --num-requests 256 --request-rate "${RATE:-16}" --input-len 128:1024 \
        --output-len 64:256
    kill -INT $server; wait $server
  done
fi

if has structured; then
  # Structured outputs under continuous load: plain phases (no schema) and schema phases
  # (a fraction of the requests with a JSON schema) alternate on one base server. The
  # model's usual made-up tokenizer (one word a token) cannot spell JSON: this one is
  # byte-level. Random weights would write whitespace between JSON tokens up to
  # max_tokens: the server allows none, so each answer is JSON that ends by itself.
  stamp structured
  python3 -m benchmarks.make_bench_setup --out /tmp/bench/bytes --num-adapters 0 \
      --tokenizer bytes > "$OUT/structured_setup.log" 2>&1
  STRUCT_CONFIG='{"disable_any_whitespace": true}'
  python3 -m loraserve.cli serve /tmp/bench/bytes/llama3-8b-shape --load-format dummy \
      --max-num-seqs 64 --port 8013 --structured-outputs-config "$STRUCT_CONFIG" \
      ${STRUCT_SERVER_ARGS:-} > "$OUT/server_structured.log" 2>&1 &
  server=$!
  for _ in $(seq "${STRUCT_START_TIMEOUT:-300}"); do
    curl -sf http://127.0.0.1:8013/v1/models > /dev/null && break; sleep 1
  done
  server_cmd="python3 -m loraserve.cli serve /tmp/bench/bytes/llama3-8b-shape"
  server_cmd+=" --load-format dummy --max-num-seqs 64 --port 8013"
  server_cmd+=" --structured-outputs-config '$STRUCT_CONFIG' ${STRUCT_SERVER_ARGS:-}"
  warmup=(--warmup-phases schema)  # the first run only: the server is warm after it
  for fraction in ${STRUCT_FRACTIONS:-0.03125 0.25}; do
    stamp "structured $fraction"
    timeout "${STRUCT_TIMEOUT:-90}" python3 -m benchmarks.serve http://127.0.0.1:8013 \
        --phases "${STRUCT_PHASES:-plain,schema,plain,schema}" ${warmup[@]+"${warmup[@]}"} \
        --structured-fraction "$fraction" --num-requests "${STRUCT_REQUESTS:-256}" \
        --max-concurrency 32 --num-clients 4 --input-len 128:512 --output-len 128 \
        --json "$OUT/structured_$fraction.json" --results-md "$OUT/structured.md" \
        --label "c32 schema $fraction" --server-command "$server_cmd" \
        > "$OUT/structured_$fraction.log" 2>&1
    echo "rc=$?" >> "$OUT/structured_$fraction.log"
    warmup=()
  done
  kill -INT $server; wait $server
fi

if has steps; then
  # Base against LoRA per kind of step (decode only, decode plus a prefill chunk):
  # host, wall and GPU kernel time of one step.
  for mode in $GRAPH_MODES; do
    stamp "steps $mode"
    timeout "${BENCH_TIMEOUT:-300}" python3 -m benchmarks.profile.steps \
        --model $MODEL --load-format dummy --adapters $ADAPTERS --cudagraph-mode "$mode" \
        --json "$OUT/steps_$mode.json" ${STEPS_ARGS:-} > "$OUT/steps_$mode.log" 2>&1
    echo "steps rc=$?" >> "$OUT/steps_$mode.log"
  done
fi
if has many; then
  stamp many
  RESULTS_DIR="$OUT" MODEL=$MODEL bash benchmarks/many_adapters.sh > "$OUT/many.log" 2>&1
  echo "many rc=$?" >> "$OUT/many.log"
fi

stamp done
tail -n 4 "$OUT"/*.log
grep -h "output_tok_per_s\|lora_over_base\|capture_s\|graph_replay\|engine_step" "$OUT"/*.json \
    "$OUT"/profile/*.json 2>/dev/null || true
