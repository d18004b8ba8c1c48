"""Chat with the base model and with a LoRA adapter through the official openai client.

Start the server first (the built-in SmolLM2 model and the demo pirate adapter):

    loraserve serve smollm2-135m-instruct --enable-lora \
        --lora-modules pirate=examples/adapters/pirate

then run:

    python examples/openai_chat_completion.py [--base-url http://127.0.0.1:8000/v1]

`model=` picks what answers: the base model's name, or an adapter's name.
"""

from __future__ import annotations

import argparse

from openai import OpenAI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="EMPTY", help="the server's --api-key, if any")
    parser.add_argument("--question", default="What is the capital of France?")
    args = parser.parse_args()

    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    models = [m.id for m in client.models.list().data]
    print("served:", ", ".join(models))
    messages = [{"role": "user", "content": args.question}]

    for model in models:
        reply = client.chat.completions.create(
            model=model, messages=messages, max_tokens=64, temperature=0.0
        )
        print(f"\n[{model}] {reply.choices[0].message.content}")

    # Streaming, with the token usage in the last chunk.
    print(f"\n[{models[-1]}, streamed] ", end="", flush=True)
    stream = client.chat.completions.create(
        model=models[-1], messages=messages, max_tokens=64, temperature=0.0, stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage:
            print(f"\n({chunk.usage.completion_tokens} tokens)")


if __name__ == "__main__":
    main()
