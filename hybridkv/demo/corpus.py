"""The demo model's training text: simple English stories and chats, generated from templates.

No data is downloaded or shipped as a file: a seeded generator writes a few tens of KB of
short stories and user/assistant exchanges about colours, animals, sums, opposites, days and
capitals. The facts are fixed tables, so every sample states them the same way and a model
of a million parameters trained for some CPU-minutes can pick up both the chat format and
the answers. A different seed gives different samples of the same distribution, which the
tests use as held-out text.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")
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


class _Dealer:
    """The corpus's random choices; a fact table's entries are dealt like cards.

    Each table is a deck, shuffled and dealt to the end before it is shuffled again, so
    every fact is asked equally often (within one round). Drawn independently, the
    counts of a small corpus scatter widely: with ``random.choice`` the shipped v2 corpus
    asked the capital of Germany 12 times and that of France 8, and the model trained on
    it answered "What is the capital of France?" with Germany's capital.
    """

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self._decks: dict[str, list[Any]] = {}

    def deal(self, deck: str, cards: Sequence[T]) -> T:
        """The next card of ``deck`` (``cards`` in a fresh shuffled order once it runs out)."""
        left = self._decks.get(deck)
        if not left:
            left = self._decks[deck] = list(cards)
            self.rng.shuffle(left)
        return left.pop()


# Capitals are dealt twice as often as the other kinds: answering one means copying the
# country from the question and recalling its capital, which the model learnt last. The v2
# recipe (600 steps, capitals as often as colours) answered 8 of the 10 capitals right,
# asked alone; balanced decks alone, 5 of 10 (3 of 10 after the demo's first three turns).
FACT_KINDS = ("color", "animal", "animal", "sum", "opposite", "day", "capital", "capital", "count")
ANIMAL_QUESTIONS = ("say", "live", "eat")


def _fact(dealer: _Dealer) -> tuple[str, str]:
    """One question and its answer, dealt from the fact tables."""
    kind = dealer.deal("kind", FACT_KINDS)
    if kind == "color":
        thing = dealer.deal(kind, sorted(COLORS))
        return f"What color is the {thing}?", f"The {thing} is {COLORS[thing]}."
    if kind == "animal":
        animal, question = dealer.deal(
            kind, [(a, q) for a in sorted(ANIMALS) for q in ANIMAL_QUESTIONS]
        )
        sound, home, food = ANIMALS[animal]
        if question == "say":
            return f"What does a {animal} say?", f'A {animal} says "{sound}".'
        if question == "live":
            return f"Where does a {animal} live?", f"A {animal} lives {home}."
        return f"What does a {animal} eat?", f"A {animal} eats {food}."
    if kind == "sum":
        a, b = dealer.deal(kind, [(a, b) for a in range(10) for b in range(10)])
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    if kind == "opposite":
        word = dealer.deal(kind, sorted(OPPOSITES))
        return f"What is the opposite of {word}?", f"The opposite of {word} is {OPPOSITES[word]}."
    if kind == "day":
        i = dealer.deal(kind, range(7))
        return f"What day comes after {DAYS[i]}?", f"After {DAYS[i]} comes {DAYS[(i + 1) % 7]}."
    if kind == "capital":
        country = dealer.deal(kind, sorted(CAPITALS))
        return (
            f"What is the capital of {country}?",
            f"The capital of {country} is {CAPITALS[country]}.",
        )
    n = dealer.deal(kind, range(3, 10))
    return f"Count to {NUMBER_WORDS[n]}.", ", ".join(str(i) for i in range(1, n + 1)) + "."


def _exchange(dealer: _Dealer) -> tuple[str, str]:
    """One user turn and the assistant's reply: small talk, a fact or a story."""
    rng = dealer.rng
    roll = rng.random()
    if roll < 0.2:
        prompts, replies = rng.choice(SMALL_TALK)
        return rng.choice(prompts), rng.choice(replies)
    if roll < 0.3:
        return rng.choice(["Tell me a story.", "Can you tell me a short story?"]), _story(rng)
    return _fact(dealer)


def _chat(dealer: _Dealer) -> tuple[Message, ...]:
    """One to five exchanges, sometimes after a system prompt: the demo asks its five
    questions in one conversation (v2's chats had at most three exchanges)."""
    rng = dealer.rng
    messages: list[Message] = []
    if rng.random() < 0.25:
        messages.append({"role": "system", "content": SYSTEM_PROMPT})
    for _ in range(rng.choice([1, 1, 2, 3, 4, 5])):
        question, answer = _exchange(dealer)
        messages.append({"role": "user", "content": question})
        messages.append({"role": "assistant", "content": answer})
    return tuple(messages)


def documents(seed: int = 0, num_chars: int = 60_000) -> list[Document]:
    """Stories and chats until about ``num_chars`` characters; the same seed, the same list."""
    rng = random.Random(seed)
    dealer = _Dealer(rng)
    # A story is five times as long as a chat: one in eight documents keeps chats the
    # larger share of tokens, which is what the demo is used for.
    makers: list[Callable[[], Document]] = [
        lambda: Document(text=_story(rng)),
        *[lambda: Document(messages=_chat(dealer))] * 7,
    ]
    docs: list[Document] = []
    total = 0
    while total < num_chars:
        doc = rng.choice(makers)()
        docs.append(doc)
        total += len(doc.text or "") + sum(len(m["content"]) + 16 for m in doc.messages)
    return docs
