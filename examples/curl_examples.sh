#!/usr/bin/env bash
# The OpenAI endpoints with curl. Start the server first:
#   LORASERVE_ALLOW_RUNTIME_LORA_UPDATING=true loraserve serve smollm2-135m-instruct \
#       --enable-lora --lora-modules pirate=examples/adapters/pirate
# Add -H "Authorization: Bearer $KEY" when the server runs with --api-key.
set -euo pipefail
URL=${URL:-http://127.0.0.1:8000}

echo "# the base model and every adapter"
curl -s "$URL/v1/models"; echo

echo "# chat through the pirate adapter"
curl -s "$URL/v1/chat/completions" -H 'Content-Type: application/json' -d '{
  "model": "pirate",
  "messages": [{"role": "user", "content": "What is the capital of France?"}],
  "max_tokens": 48, "temperature": 0
}'; echo

echo "# a streamed completion from the base model (server-sent events)"
curl -sN "$URL/v1/completions" -H 'Content-Type: application/json' -d '{
  "model": "smollm2-135m-instruct",
  "prompt": "The best thing about the sea is",
  "max_tokens": 8, "temperature": 0, "stream": true, "stream_options": {"include_usage": true}
}'; echo

echo "# health, version, metrics"
curl -s -o /dev/null -w "health: %{http_code}\n" "$URL/health"
curl -s "$URL/version"; echo
curl -s "$URL/metrics" | grep '^loraserve:lora_requests_info' || true
