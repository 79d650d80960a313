"""Built-in workloads for `specq bench --workload`: where does each drafter pay?

Each is a list of chat conversations made deterministically here (no data file to ship),
short enough for a small instruct model such as SmolLM2-135M-Instruct:

- rewrite:   input-grounded rewriting of a given passage (formal, corrected, past tense):
             the answer copies from the prompt, prompt lookup's home ground;
- json:      extraction with one fixed schema from short texts: every answer shares the
             JSON skeleton, and every prompt a long instruction prefix;
- synthesis: one template rendered for seed rows, several samples per row (each sample
             a different slot: greedy decoding would make identical samples otherwise);
- chat:      open questions: little to copy from anywhere, the control.
"""

from __future__ import annotations

from collections.abc import Callable

from specq.schema.generation import Message

ALL = "all"

_PASSAGES = [
    "hey guys the meeting got moved to 3pm tomorrow, dont be late and bring the slides "
    "and the budget numbers for the second quarter",
    "i walk to the market every morning, buy fresh bread and talk to the baker about the "
    "weather and the football",
    "the library close for two week in august because they replace the heating system, "
    "you can return books at the town hall",
    "our team finish the project early, the client is happy and we gets a bonus at the "
    "end of the month",
    "she dont like the new office, it is too noisy and the coffee machine never work "
    "properly",
    "we is planning a trip to the mountains in july, we will hike every day and sleep in "
    "small huts",
    "the shop sell fresh vegetables, cheese and bread, and it open every day except "
    "sunday",
    "my brother fix old bicycles in his garage and sell them to students for a fair "
    "price",
]
_REWRITES = [
    "Rewrite the following passage in formal English.",
    "Correct the spelling and grammar of the following passage.",
    "Rewrite the following passage in the past tense.",
]

_JSON_INSTRUCTION = (
    'Extract the person described in the text as a JSON object with exactly these keys: '
    '"name" (string), "age" (integer), "city" (string), "job" (string). '
    "Answer with the JSON object only."
)
_NAMES = ["Maria Lopez", "John Smith", "Aiko Tanaka", "Peter Novak", "Fatima Khan",
          "Lucas Martin", "Emma Brown", "Omar Haddad", "Sofia Rossi", "David Cohen",
          "Nina Petrova", "Carlos Silva"]
_CITIES = ["Madrid", "London", "Osaka", "Prague", "Lahore", "Lyon", "Dublin", "Beirut",
           "Milan", "Haifa", "Kazan"]
_JOBS = ["nurse", "teacher", "engineer", "baker", "lawyer", "pilot", "chef", "architect",
         "farmer", "journalist"]
_JSON_TEXTS = [
    "{name} is a {age}-year-old {job} who lives in {city}.",
    "Born {age} years ago, {name} now works as a {job} in {city}.",
    "In {city}, {name} ({age}) has worked as a {job} for many years.",
    "{name}, {job}, age {age}, moved to {city} last spring.",
]

_SYNTHESIS_TEMPLATE = (
    "Write a one-sentence product description for {product}, aimed at {audience}, that "
    "highlights its {aspect}."
)
_SEED_ROWS = [("a steel water bottle", "hikers"), ("a wool winter hat", "children"),
              ("a folding bicycle", "city commuters"), ("a cast iron pan", "home cooks"),
              ("a desk lamp", "students"), ("a travel backpack", "business travellers"),
              ("a garden hose", "gardeners"), ("a pair of running shoes", "beginners")]
_ASPECTS = ["price", "durability", "design"]  # one sample per slot value

_QUESTIONS = [
    "Why is the sky blue?", "What makes a good friend?", "How do bees make honey?",
    "What is the best way to learn a new language?", "Why do cats purr?",
    "What should I cook for dinner tonight?", "How does a rainbow form?",
    "What are the benefits of reading books?", "Why do leaves change colour in autumn?",
    "How can I sleep better at night?", "What is the difference between weather and "
    "climate?", "Why do we dream?", "What is a good hobby for a rainy day?",
    "How do airplanes stay in the air?", "What is the meaning of kindness?",
    "How can I save money each month?", "Why is exercise important?",
    "What makes music enjoyable?", "How do plants grow?", "What is the moon made of?",
    "How should I prepare for a job interview?", "Why do people travel?",
    "What is the history of the bicycle?", "How do computers store information?",
]


def _user(text: str) -> list[Message]:
    return [Message(role="user", content=text)]


def rewrite() -> list[list[Message]]:
    return [_user(f"{how}\n\n{p}") for p in _PASSAGES for how in _REWRITES]


def json_extraction() -> list[list[Message]]:
    out = []
    for i in range(32):
        person = dict(name=_NAMES[i % len(_NAMES)], age=23 + (i * 7) % 41,
                      city=_CITIES[i % len(_CITIES)], job=_JOBS[i % len(_JOBS)])
        text = _JSON_TEXTS[i % len(_JSON_TEXTS)].format(**person)
        out.append(_user(f"{_JSON_INSTRUCTION}\n\nText: {text}"))
    return out


def synthesis() -> list[list[Message]]:
    return [_user(_SYNTHESIS_TEMPLATE.format(product=p, audience=a, aspect=x))
            for p, a in _SEED_ROWS for x in _ASPECTS]


def chat() -> list[list[Message]]:
    return [_user(q) for q in _QUESTIONS]


WORKLOADS: dict[str, Callable[[], list[list[Message]]]] = {
    "rewrite": rewrite, "json": json_extraction, "synthesis": synthesis, "chat": chat,
}


def workload_names(text: str) -> list[str]:
    """Comma-separated workload names, or ``all``; ValueError names an unknown one."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    if ALL in names:
        return list(WORKLOADS)
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown or not names:
        raise ValueError(f"unknown workload(s) {unknown}; known: {', '.join(WORKLOADS)}, {ALL}")
    return names
