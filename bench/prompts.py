"""The bench's prompts: input-grounded chat tasks, whose answers copy from the input."""

from __future__ import annotations

import json
from pathlib import Path

from specq.schema.generation import Message

# guess them; open-ended tasks would measure the draft, not the engine.
PROMPTS: list[str] = [
    "Rewrite in formal English: hey guys the meeting got moved to 3pm tmrw dont be late, "
    "bring the slides and the budget numbers",
    "Correct the spelling: I recieved teh package on wensday and it was broken, so I "
    "returned it to the shop on thursday.",
    "Extract the names of people from: Alice met Bob and Carol at the station in Paris, "
    "then David drove them to the museum.",
    "Summarise in one sentence: The city council voted to extend the bike lane network by "
    "twenty kilometres, citing a rise in cycling commuters and fewer road accidents.",
    "Translate to French: The cat sleeps on the red sofa while the dog plays in the garden.",
    'Reformat as JSON with keys "name", "age" and "city": Maria Lopez, 34, lives in Madrid.',
    "Rewrite as a question: The train leaves at nine o'clock from platform four.",
    "Fix the grammar: she don't like them apples and he go to school yesterday with his "
    "friends.",
    "List the numbers in: we sold 12 apples, 7 pears and 30 plums on Monday, and 5 melons "
    "on Tuesday.",
    "Rewrite in the past tense: I walk to the market, buy fresh bread and talk to the baker.",
    "Extract the dates from: The contract starts on 1 March 2024 and ends on 28 February "
    "2025, with a review on 1 September 2024.",
    "Convert to a bulleted list: eggs, milk, flour, sugar, butter and a pinch of salt.",
    "Rewrite politely: Send me the report now, I have been waiting all day.",
    "Summarise in one sentence: The library will close for two weeks in August to replace "
    "its heating system, and books can be returned at the town hall meanwhile.",
    'Reformat as JSON with keys "product" and "price": The blue kettle costs 25 euros.',
    "Correct the punctuation: where are you going she asked i am going home he said",
]


class PromptFileError(ValueError):
    """A prompts file line that is not a prompt; the message names the line."""


def load_prompts(n: int, path: Path | str | None = None) -> list[list[Message]]:
    """``n`` chat conversations: the built-in prompts (or those of a JSONL file), cycled.

    A JSONL line is a string, {"prompt": str} or {"messages": [{"role", "content"}...]}.
    """
    convs = [[Message(role="user", content=p)] for p in PROMPTS]
    if path is not None:
        convs = []
        for num, line in enumerate(Path(path).read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                if isinstance(item, str):
                    item = {"prompt": item}
                if "messages" in item:
                    convs.append([Message(**m) for m in item["messages"]])
                else:
                    convs.append([Message(role="user", content=str(item["prompt"]))])
            except (ValueError, KeyError, TypeError) as exc:
                raise PromptFileError(f"{path}:{num}: not a prompt ({exc})") from exc
        if not convs:
            raise PromptFileError(f"{path}: no prompts")
    return [convs[i % len(convs)] for i in range(n)]
