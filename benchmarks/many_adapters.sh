#!/usr/bin/env bash
# Many adapters per GPU: one `loraserve serve` per setting (dummy weights of MODEL), under
# the load of `python -m benchmarks.serve` with a LoRA warm-up phase, then base and LoRA
# phases alternating (the medians of each kind), input 128-1024 and output 64-256 tokens.
# Every run appends its rows to RESULTS_DIR/many.md: throughput, TTFT p50/p99, ITL p50/p99,
# the longest wait, failed requests, the server's distinct adapters per step, its start-up
# time and graph and KV memory (from its log), and the exact server and client commands.
# The `many` stage of gpu_suite.sh runs it; on its own, from the repository root, after
# `python -m benchmarks.make_bench_setup --out /tmp/bench`:
#
#   MANY_RUNS="slots32 slots256" bash benchmarks/many_adapters.sh
#
# Runs (MANY_RUNS picks some, by name; about 6 minutes for all on an H200 with the defaults):
#   slots32    32 adapters in --max-loras 32, uniform, concurrency 16 and 64
#   slots256   the same 32 adapters in --max-loras 256, concurrency 64 (against slots32's)
#   zipf256    256 adapters (rank 16, all projections; 8 weight files), Zipf alpha 1,
#              concurrency 64, --max-loras MANY_ZIPF_MAX_LORAS (default 64)
#   short8     32 adapters on --max-loras 8, uniform, concurrency 64, once per scheduling
#              policy of LORA_POLICIES (default "fcfs slot-aware"), each passed to the server
#              as LORA_SCHED_FLAG POLICY (default flag --lora-scheduling); LORA_POLICIES=""
#              runs once without the flag
#   churn1024  1,024 adapters registered (rank 8 on the attention projections; 8 weight
#              files), --max-cpu-loras 128, Zipf alpha 1: Poisson arrivals at MANY_RATE/s
#              (default 16), then concurrency 64; --max-loras MANY_CHURN_MAX_LORAS (default 64)
# Settings:
#   RESULTS_DIR  where many.md and the logs and JSON go (default gpu_results)
#   MODEL        the model folder (default /tmp/bench/llama3-8b-shape)
#   MANY_CONFIG32  a `serve --config` file registering lora0..lora31 (default the one
#                make_bench_setup wrote beside MODEL)
#   MANY_DIR     where the 256 and 1,024 adapters are made (default MODEL's folder)
#   MANY_REQUESTS requests per phase at concurrency 64 (default 96); MANY_REQUESTS_C16 at 16
#                (default 48); MANY_RATE_REQUESTS at the Poisson rate (default 128)
#   MANY_INPUT, MANY_OUTPUT  prompt and output tokens, N or LO:HI (default 128:1024, 64:256)
#   MANY_PHASES  the timed phases (default base,lora,base,lora); MANY_WARMUP the untimed
#                ones before them (default lora; empty for none)
#   MANY_SERVER_ARGS  more server flags (e.g. --cudagraph-mode FULL_AND_PIECEWISE)
#   MANY_TIMEOUT seconds for one benchmark run (default 200); MANY_START_TIMEOUT for a
#                server's start (default 300); PORT (default 8012)
#   MANY_BUDGET  seconds for the whole script (default 0: no limit). Each server start and
#                benchmark run gets at most what is left; one that cannot have
#                MANY_MIN_SECONDS (default 45) is skipped with a "not run" row, so the
#                script ends by itself with a full table instead of being killed by an
#                outer timeout. A TERM or INT stops the running server before the script
#                exits (after the benchmark run in the foreground returns).
set -uo pipefail
OUT=${RESULTS_DIR:-gpu_results}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
MODEL=${MODEL:-/tmp/bench/llama3-8b-shape}
BENCH=$(dirname "$MODEL")
CONFIG32=${MANY_CONFIG32:-$BENCH/lora_modules.json}
DIR=${MANY_DIR:-$BENCH}
PORT=${PORT:-8012}
TABLE="$OUT/many.md"
BUDGET=${MANY_BUDGET:-0}
T_START=$(date +%s)
server=""
export PYTHONUNBUFFERED=1 LORASERVE_NO_PROGRESS=1
stamp() { echo "$(date +%T) $*" >> "$OUT/stages.log"; }
want() { [ -z "${MANY_RUNS:-}" ] || [[ " $MANY_RUNS " == *" $1 "* ]]; }

# The table's header, once: benchmarks.serve adds it only to a new file, and the rows
# written here for a run that could not finish need it too.
[ -s "$TABLE" ] || python3 -c "from benchmarks.serve.report import RESULTS_HEADER
print('\n'.join(RESULTS_HEADER))" > "$TABLE"

# A "-" for each figure column of the table (all but run, model, notes and command).
FIGURES=$(python3 -c "from benchmarks.serve.report import RESULTS_HEADER
print(' | '.join(['-'] * (RESULTS_HEADER[0].count('|') - 5)))")
failed_row() {  # run name, what went wrong, where to look
  echo "| $1 | $2 | $FIGURES | see $3 | \`$server_cmd\` |" >> "$TABLE"
}

seconds_left() {  # of MANY_BUDGET, or a day when there is none
  if [ "$BUDGET" -gt 0 ]; then echo $((BUDGET - $(date +%s) + T_START)); else echo 86400; fi
}

within_budget() {  # run name, the seconds it would like: false (and a row) if too few are left
  local left
  left=$(seconds_left)
  [ "$left" -ge "${MANY_MIN_SECONDS:-45}" ] && return 0
  failed_row "$1" "not run: ${left} s of MANY_BUDGET left" "stages.log"
  stamp "many $1 skipped: ${left} s left"
  return 1
}

cap() {  # the smaller of a limit and the budget's seconds left
  local left
  left=$(seconds_left)
  echo $(( $1 < left ? $1 : left ))
}

setup_adapters() {  # folder, then make_bench_setup's flags: adapters for MODEL
  local dir=$1; shift
  stamp "many setup $dir"
  python3 -m benchmarks.make_bench_setup --out "$dir" --base-model "$MODEL" "$@" \
      >> "$OUT/many_setup.log" 2>&1
}

stop_server() {  # SIGINT, then SIGKILL after 60 s (the engine core dies with its parent)
  [ -n "$server" ] || return 0
  kill -INT "$server" 2> /dev/null
  for _ in $(seq 60); do kill -0 "$server" 2> /dev/null || break; sleep 1; done
  kill -KILL "$server" 2> /dev/null
  wait "$server" 2> /dev/null
  server=""
}
# A server must not outlive the script: it would hold the port and the GPU's memory.
trap 'stop_server; exit 143' TERM
trap 'stop_server; exit 130' INT

start_server() {  # name, then the server's flags; sets server, server_cmd and notes
  local name=$1; shift
  local cmd=(python3 -m loraserve.cli serve "$MODEL" --load-format dummy --enable-lora
             --max-lora-rank 16 --port "$PORT" "$@" ${MANY_SERVER_ARGS:-})
  server_cmd="${cmd[*]}"
  within_budget "$name" || return 1
  stamp "many server $name"
  local log="$OUT/many_server_$name.log" ready="" t0 t1
  t0=$(date +%s.%N)
  "${cmd[@]}" > "$log" 2>&1 &
  server=$!
  for _ in $(seq $((2 * $(cap "${MANY_START_TIMEOUT:-300}")))); do
    curl -sf "http://127.0.0.1:$PORT/v1/models" > /dev/null && { ready=1; break; }
    kill -0 "$server" 2> /dev/null || break
    sleep 0.5
  done
  t1=$(date +%s.%N)
  # Start-up to a listed /v1/models, and what the server logged of its graphs and KV cache.
  notes="start $(awk "BEGIN {printf \"%.1f\", $t1 - $t0}") s"
  local logged
  logged=$(grep -ho 'captured .* GiB\|KV cache: .* GiB' "$log" | paste -sd ';' -)
  [ -n "$logged" ] && notes="$notes; $logged"
  if [ -z "$ready" ]; then
    failed_row "$name" "server did not start" "$(basename "$log")"
    stop_server
    return 1
  fi
}

bench() {  # run name, then benchmarks.serve's arguments
  local name=$1; shift
  local warm=${MANY_WARMUP-lora}
  within_budget "$name" || return 0
  stamp "many $name"
  timeout "$(cap "${MANY_TIMEOUT:-200}")" python3 -m benchmarks.serve "http://127.0.0.1:$PORT" \
      --phases "${MANY_PHASES:-base,lora,base,lora}" ${warm:+--warmup-phases "$warm"} \
      --num-clients 4 --input-len "${MANY_INPUT:-128:1024}" \
      --output-len "${MANY_OUTPUT:-64:256}" --adapter-pattern 'lora{}' \
      --results-md "$TABLE" --label "$name" --notes "$notes" \
      --server-command "$server_cmd" --json "$OUT/many_$name.json" "$@" \
      > "$OUT/many_$name.log" 2>&1
  local rc=$?
  echo "rc=$rc" >> "$OUT/many_$name.log"
  # rc 1: the run finished with failed requests, counted in its rows; others left none.
  [ $rc -gt 1 ] && failed_row "$name" "run did not finish (rc=$rc)" "many_$name.log"
  return 0
}

C64=(--max-concurrency 64 --num-requests "${MANY_REQUESTS:-96}")
UNIFORM32=(--num-adapters 32 --adapter-dist uniform)

if want slots32 && start_server slots32 --max-loras 32 --max-cpu-loras 32 \
    --config "$CONFIG32"; then
  bench slots32_c16 "${UNIFORM32[@]}" --max-concurrency 16 \
      --num-requests "${MANY_REQUESTS_C16:-48}"
  bench slots32_c64 "${UNIFORM32[@]}" "${C64[@]}"
  stop_server
fi

if want slots256 && start_server slots256 --max-loras 256 --max-cpu-loras 256 \
    --config "$CONFIG32"; then
  bench slots256_c64 "${UNIFORM32[@]}" "${C64[@]}"
  stop_server
fi

if want zipf256; then
  setup_adapters "$DIR/many256" --num-adapters 256 --distinct 8 --rank 16
  if start_server zipf256 --max-loras "${MANY_ZIPF_MAX_LORAS:-64}" --max-cpu-loras 256 \
      --config "$DIR/many256/lora_modules.json"; then
    bench zipf256_c64 --num-adapters 256 --adapter-dist zipf --zipf-alpha 1 "${C64[@]}"
    stop_server
  fi
fi

if want short8; then
  read -ra policies <<< "${LORA_POLICIES-fcfs slot-aware}"
  [ ${#policies[@]} -eq 0 ] && policies=("")  # no policy named: one run without the flag
  for policy in "${policies[@]}"; do
    name=short8${policy:+_$policy}
    flag=()
    [ -n "$policy" ] && flag=("${LORA_SCHED_FLAG:---lora-scheduling}" "$policy")
    if start_server "$name" --max-loras 8 --max-cpu-loras 32 "${flag[@]}" \
        --config "$CONFIG32"; then
      bench "${name}_c64" "${UNIFORM32[@]}" "${C64[@]}"
      stop_server
    fi
  done
fi

if want churn1024; then
  setup_adapters "$DIR/many1024" --num-adapters 1024 --distinct 8 --rank 8 \
      --target-modules attention
  if start_server churn1024 --max-loras "${MANY_CHURN_MAX_LORAS:-64}" --max-cpu-loras 128 \
      --config "$DIR/many1024/lora_modules.json"; then
    ZIPF1024=(--num-adapters 1024 --adapter-dist zipf --zipf-alpha 1)
    bench churn1024_poisson "${ZIPF1024[@]}" --request-rate "${MANY_RATE:-16}" \
        --num-requests "${MANY_RATE_REQUESTS:-128}"
    bench churn1024_c64 "${ZIPF1024[@]}" "${C64[@]}"
    stop_server
  fi
fi
cat "$TABLE"
