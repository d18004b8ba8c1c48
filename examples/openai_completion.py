"""Plain completions with the base model and an adapter, through the openai client.

    loraserve serve smollm2-135m-instruct --enable-lora \
        --lora-modules pirate=examples/adapters/pirate
    python examples/openai_completion.py

vLLM's extra sampling fields (top_k, min_p, repetition_penalty, ignore_eos,
stop_token_ids) go in `extra_body`.
"""

from __future__ import annotations

import argparse

from openai import OpenAI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="EMPTY")
    parser.add_argument("--model", action="append", default=None,
                        help="model or adapter name (repeatable; default: all served)")
    args = parser.parse_args()

    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    models = args.model or [m.id for m in client.models.list().data]
    prompt = "The best thing about the sea is"
    for model in models:
        result = client.completions.create(
            model=model, prompt=prompt, max_tokens=32, temperature=0.7, seed=0,
            extra_body={"top_k": 40, "repetition_penalty": 1.1},
        )
        print(f"[{model}] {prompt}{result.choices[0].text}")

    # Streaming with per-token log probabilities.
    stream = client.completions.create(
        model=models[-1], prompt=prompt, max_tokens=8, temperature=0.0, logprobs=2, stream=True
    )
    for chunk in stream:
        for choice in chunk.choices:
            if choice.logprobs:
                for token, logprob in zip(choice.logprobs.tokens,
                                          choice.logprobs.token_logprobs, strict=False):
                    print(f"{token!r:>14} {logprob:8.4f}")


if __name__ == "__main__":
    main()
