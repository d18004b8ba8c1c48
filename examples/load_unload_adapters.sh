#!/usr/bin/env bash
# Load and unload adapters while the server runs. Runtime updates must be enabled:
#   LORASERVE_ALLOW_RUNTIME_LORA_UPDATING=true loraserve serve smollm2-135m-instruct \
#       --enable-lora --lora-modules pirate=examples/adapters/pirate
# It loads the demo adapter a second time, under the name $NAME (default buccaneer).
# Status codes follow vLLM: 200 on success; 400 for a name already loaded (unless
# "load_inplace": true) or an adapter that fails to load (the body says why);
# 404 when unloading a name the server does not know.
set -euo pipefail
URL=${URL:-http://127.0.0.1:8000}
ADAPTER=${ADAPTER:-$(cd "$(dirname "$0")" && pwd)/adapters/pirate}
NAME=${NAME:-buccaneer}

show() { curl -s -w "  [HTTP %{http_code}]\n" "$@"; }

echo "# load"
show "$URL/v1/load_lora_adapter" -H 'Content-Type: application/json' \
  -d "{\"lora_name\": \"$NAME\", \"lora_path\": \"$ADAPTER\"}"

echo "# load the same name again: 400 ..."
show "$URL/v1/load_lora_adapter" -H 'Content-Type: application/json' \
  -d "{\"lora_name\": \"$NAME\", \"lora_path\": \"$ADAPTER\"}"

echo "# ... unless it replaces the weights in place"
show "$URL/v1/load_lora_adapter" -H 'Content-Type: application/json' \
  -d "{\"lora_name\": \"$NAME\", \"lora_path\": \"$ADAPTER\", \"load_inplace\": true}"

echo "# use it"
show "$URL/v1/chat/completions" -H 'Content-Type: application/json' \
  -d "{\"model\": \"$NAME\", \"messages\": [{\"role\": \"user\", \"content\": \"Hi!\"}], \"max_tokens\": 24, \"temperature\": 0}"

echo "# what the engine holds (adapter bytes in the CPU cache, device slots)"
show "$URL/v1/engine_stats"

echo "# unload: the engine drops its weights and frees the memory"
show "$URL/v1/unload_lora_adapter" -H 'Content-Type: application/json' -d "{\"lora_name\": \"$NAME\"}"
show "$URL/v1/engine_stats"

echo "# unload again: 404"
show "$URL/v1/unload_lora_adapter" -H 'Content-Type: application/json' -d "{\"lora_name\": \"$NAME\"}"
