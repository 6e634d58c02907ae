"""The demo model's training text: simple English stories and chats, generated from templates.

No data is downloaded or shipped as a file: a seeded generator writes a few tens of KB of
short stories and user/assistant exchanges about colours, animals, sums, opposites, days and
capitals. The facts are fixed tables, so every sample states them the same way and a model
of a million parameters trained for a minute can pick up both the chat format and some of
the answers. A different seed gives different samples of the same distribution, which the
tests use as held-out text.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

Message = dict[str, str]  # {"role": "system" | "user" | "assistant", "content": ...}


@dataclass(frozen=True, slots=True)
class Document:
    """One training sample: plain text (a story) or a chat (rendered by the chat template)."""

    text: str | None = None
    messages: tuple[Message, ...] = ()


COLORS = {
    "sky": "blue",
    "grass": "green",
    "snow": "white",
    "sun": "yellow",
    "banana": "yellow",
    "apple": "red",
    "sea": "blue",
    "leaf": "green",
    "coal": "black",
    "milk": "white",
    "orange": "orange",
    "cherry": "red",
}
# animal: (sound, home, food)
ANIMALS = {
    "cat": ("meow", "in a warm house", "fish"),
    "dog": ("woof", "in a little house", "meat"),
    "cow": ("moo", "on a farm", "grass"),
    "duck": ("quack", "by the pond", "bread"),
    "sheep": ("baa", "on the hill", "grass"),
    "horse": ("neigh", "in a stable", "hay"),
    "bird": ("tweet", "in a tree", "seeds"),
    "frog": ("croak", "in the pond", "flies"),
    "mouse": ("squeak", "in a hole in the wall", "cheese"),
    "lion": ("roar", "on the plains", "meat"),
    "owl": ("hoot", "in the forest", "mice"),
    "pig": ("oink", "on a farm", "apples"),
}
OPPOSITES = {
    "hot": "cold",
    "big": "small",
    "up": "down",
    "day": "night",
    "happy": "sad",
    "fast": "slow",
    "open": "closed",
    "old": "new",
    "wet": "dry",
    "light": "dark",
    "early": "late",
    "full": "empty",
}
CAPITALS = {
    "France": "Paris",
    "Spain": "Madrid",
    "Italy": "Rome",
    "Japan": "Tokyo",
    "Egypt": "Cairo",
    "Germany": "Berlin",
    "Canada": "Ottawa",
    "Kenya": "Nairobi",
    "Peru": "Lima",
    "Norway": "Oslo",
}
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
NAMES = ["Tom", "Lily", "Sam", "Mia", "Ben", "Anna", "Max", "Zoe", "Leo", "Ella"]
ADJECTIVES = ["little", "brave", "sleepy", "happy", "curious", "kind", "small", "clever"]
THINGS = ["a red ball", "a shiny stone", "a blue hat", "an old map", "a tiny key", "a kite"]
PLACES = ["under a tree", "near the river", "in the garden", "on the hill", "by the door"]
ENDINGS = [
    "That night, {name} slept well and dreamed of {thing}.",
    "{name} smiled. It was the best day ever.",
    "From that day on, {name} and the {friend} were best friends.",
    "And so {name} learned that it is good to share.",
]
SYSTEM_PROMPT = "You are a helpful assistant."
IDENTITY = (
    "I am the hybridkv demo model, a tiny model trained for about a minute on simple "
    "English text. My answers are short and sometimes wrong."
)
SMALL_TALK: list[tuple[list[str], list[str]]] = [
    (
        ["Hello!", "Hi!", "Hi there.", "Good morning!", "Hey."],
        ["Hello! How can I help you today?", "Hi! What would you like to talk about?"],
    ),
    (
        ["How are you?", "How are you today?"],
        ["I am well, thank you. How are you?", "I am fine, thanks for asking."],
    ),
    (["Thank you!", "Thanks.", "Thanks a lot!"], ["You are welcome!", "Happy to help."]),
    (["Goodbye!", "Bye.", "See you later."], ["Goodbye! Have a nice day.", "Bye! Take care."]),
    (["Who are you?", "What is your name?", "What are you?"], [IDENTITY]),
]


def _story(rng: random.Random) -> str:
    """A five-to-seven sentence story about one named animal."""
    name, adj = rng.choice(NAMES), rng.choice(ADJECTIVES)
    animal, friend = rng.sample(sorted(ANIMALS), 2)
    sound, home, food = ANIMALS[animal]
    thing, place = rng.choice(THINGS), rng.choice(PLACES)
    sentences = [
        f"Once upon a time, there was a {adj} {animal} named {name}.",
        f"{name} lived {home} and liked to eat {food}.",
        f"One day, {name} found {thing} {place}.",
        f'"{sound.capitalize()}!" said {name}. "What is this?"',
        f'A {friend} came by and said, "{ANIMALS[friend][0].capitalize()}! Let\'s play."',
        f"The {friend} and {name} played with {thing} until the sun went down.",
        rng.choice(ENDINGS).format(name=name, thing=thing, friend=friend),
    ]
    if rng.random() < 0.5:
        del sentences[3]
    return " ".join(sentences)


def _fact(rng: random.Random) -> tuple[str, str]:
    """One question and its answer, from one of the fact tables."""
    kind = rng.randrange(8)
    if kind == 0:
        thing = rng.choice(sorted(COLORS))
        return f"What color is the {thing}?", f"The {thing} is {COLORS[thing]}."
    if kind in (1, 2):
        animal = rng.choice(sorted(ANIMALS))
        sound, home, food = ANIMALS[animal]
        return rng.choice(
            [
                (f"What does a {animal} say?", f'A {animal} says "{sound}".'),
                (f"Where does a {animal} live?", f"A {animal} lives {home}."),
                (f"What does a {animal} eat?", f"A {animal} eats {food}."),
            ]
        )
    if kind == 3:
        a, b = rng.randrange(10), rng.randrange(10)
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    if kind == 4:
        word = rng.choice(sorted(OPPOSITES))
        return f"What is the opposite of {word}?", f"The opposite of {word} is {OPPOSITES[word]}."
    if kind == 5:
        i = rng.randrange(7)
        return f"What day comes after {DAYS[i]}?", f"After {DAYS[i]} comes {DAYS[(i + 1) % 7]}."
    if kind == 6:
        country = rng.choice(sorted(CAPITALS))
        return (
            f"What is the capital of {country}?",
            f"The capital of {country} is {CAPITALS[country]}.",
        )
    n = rng.randrange(3, 10)
    return f"Count to {NUMBER_WORDS[n]}.", ", ".join(str(i) for i in range(1, n + 1)) + "."


def _exchange(rng: random.Random) -> tuple[str, str]:
    """One user turn and the assistant's reply: small talk, a fact or a story."""
    roll = rng.random()
    if roll < 0.2:
        prompts, replies = rng.choice(SMALL_TALK)
        return rng.choice(prompts), rng.choice(replies)
    if roll < 0.3:
        return rng.choice(["Tell me a story.", "Can you tell me a short story?"]), _story(rng)
    return _fact(rng)


def _chat(rng: random.Random) -> tuple[Message, ...]:
    """One to three exchanges, sometimes after a system prompt."""
    messages: list[Message] = []
    if rng.random() < 0.25:
        messages.append({"role": "system", "content": SYSTEM_PROMPT})
    for _ in range(rng.choice([1, 1, 2, 3])):
        question, answer = _exchange(rng)
        messages.append({"role": "user", "content": question})
        messages.append({"role": "assistant", "content": answer})
    return tuple(messages)


def documents(seed: int = 0, num_chars: int = 60_000) -> list[Document]:
    """Stories and chats until about ``num_chars`` characters; the same seed, the same list."""
    rng = random.Random(seed)
    # A story is five times as long as a chat: one in eight documents keeps chats the
    # larger share of tokens, which is what the demo is used for.
    makers: list[Callable[[], Document]] = [
        lambda: Document(text=_story(rng)),
        *[lambda: Document(messages=_chat(rng))] * 7,
    ]
    docs: list[Document] = []
    total = 0
    while total < num_chars:
        doc = rng.choice(makers)()
        docs.append(doc)
        total += len(doc.text or "") + sum(len(m["content"]) + 16 for m in doc.messages)
    return docs
