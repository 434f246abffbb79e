"""Regenerate the small offline corpus and tokenizer shipped in torchtitan_ext/assets/.

The corpus is procedurally generated short stories (a fixed seed, a small grammar,
plain English words), so it has real structure for a tiny model to learn and no
third-party text. The tokenizer is a byte-level BPE trained on that corpus.

    python scripts/make_tiny_assets.py
"""

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ASSETS = Path(__file__).resolve().parents[1] / "torchtitan_ext" / "assets"
NUM_DOCUMENTS = 2500
VOCAB_SIZE = 1024
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"

NAMES = [
    "Ada",
    "Bruno",
    "Chloe",
    "Dmitri",
    "Esme",
    "Farid",
    "Greta",
    "Hugo",
    "Ines",
    "Jonas",
    "Kira",
    "Liam",
    "Mina",
    "Nils",
    "Olga",
    "Pavel",
    "Rosa",
    "Sami",
    "Tess",
    "Umar",
]
ANIMALS = ["cat", "dog", "fox", "owl", "goat", "horse", "rabbit", "duck", "bear", "mouse"]
PLACES = [
    "the garden",
    "the old mill",
    "the river bank",
    "the market",
    "the forest",
    "the library",
    "the harbor",
    "the hill",
    "the kitchen",
    "the station",
]
OBJECTS = [
    "a red ball",
    "a small key",
    "a blue kite",
    "an old map",
    "a warm loaf",
    "a silver bell",
    "a paper boat",
    "a wooden box",
    "a green apple",
    "a long rope",
]
FEELINGS = ["happy", "tired", "curious", "brave", "sleepy", "proud", "calm", "surprised"]
WEATHER = ["sunny", "rainy", "windy", "cold", "bright", "foggy", "warm", "quiet"]
VERBS = ["found", "carried", "lost", "painted", "shared", "hid", "fixed", "opened"]


def sentence(rng: random.Random, hero: str, pet: str) -> str:
    templates = [
        lambda: f"{hero} went to {rng.choice(PLACES)} with the {pet}.",
        lambda: f"The day was {rng.choice(WEATHER)} and {hero} felt {rng.choice(FEELINGS)}.",
        lambda: f"At {rng.choice(PLACES)}, {hero} {rng.choice(VERBS)} {rng.choice(OBJECTS)}.",
        lambda: f"The {pet} {rng.choice(VERBS)} {rng.choice(OBJECTS)} near {rng.choice(PLACES)}.",
        lambda: f'{hero} said to {rng.choice(NAMES)}, "Let us go to {rng.choice(PLACES)}."',
        lambda: f"Then the {pet} was {rng.choice(FEELINGS)}, because it was {rng.choice(WEATHER)}.",
        lambda: f"{hero} counted {rng.randint(2, 9)} birds and {rng.randint(2, 9)} stones.",
    ]
    return rng.choice(templates)()


def story(rng: random.Random) -> str:
    hero, pet = rng.choice(NAMES), rng.choice(ANIMALS)
    opening = f"Once upon a time, {hero} had a {pet}."
    body = " ".join(sentence(rng, hero, pet) for _ in range(rng.randint(3, 8)))
    ending = f"In the end, {hero} and the {pet} went home {rng.choice(FEELINGS)}."
    return f"{opening} {body} {ending}"


def main() -> None:
    rng = random.Random(1234)
    documents = [story(rng) for _ in range(NUM_DOCUMENTS)]

    corpus_dir = ASSETS / "tiny_stories"
    corpus_dir.mkdir(parents=True, exist_ok=True)
    with open(corpus_dir / "train.jsonl", "w") as f:
        for text in documents:
            f.write(json.dumps({"text": text}) + "\n")

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)

    tokenizer_dir = ASSETS / "tokenizer"
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(tokenizer_dir / "tokenizer.json"))
    with open(tokenizer_dir / "tokenizer_config.json", "w") as f:
        json.dump(
            {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": True},
            f,
            indent=2,
        )
    print(f"{len(documents)} documents, vocab {tokenizer.get_vocab_size()} -> {ASSETS}")


if __name__ == "__main__":
    main()
