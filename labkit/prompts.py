"""A fixed set of prompts, so benchmarks and experiments always send the same requests."""

from __future__ import annotations

PROMPTS: tuple[str, ...] = (
    "A paged key-value cache splits each sequence's attention state into fixed-size blocks, so memory is handed out the way an operating system hands out pages.",
    "When a browser opens an event stream, it keeps the connection open and waits for the server to write lines of text that end with a blank line.",
    "The lighthouse keeper counted the ships every evening, writing their names in a ledger that nobody had opened for forty years.",
    "Explain to a new engineer why a service should refuse a request before it sends the first byte of a streaming response.",
    "In the spring of 1887, a small railway company in the north of England decided to build a bridge across the river.",
    "Write a short recipe for a tomato soup that can be made in twenty minutes with ingredients found in most kitchens.",
    "The difference between throughput and latency matters most when many users share one machine and each of them is waiting.",
    "Here is a list of questions a good code reviewer asks before approving a change to a production system:",
    "Photosynthesis converts light energy into chemical energy, and the first step happens inside the thylakoid membranes.",
    "The old map showed an island that no sailor had ever reported, drawn carefully in red ink near the edge of the paper.",
    "Continuous batching lets a server add new requests to a running batch at every step instead of waiting for the batch to finish.",
    "Describe the sound of a city at four in the morning, when the last trains have stopped and the first bakeries are opening.",
    "A good unit test names the behaviour it checks, sets up only what it needs, and fails with a message that explains what broke.",
    "The committee met on Tuesday to discuss the budget, but the conversation quickly turned to the question of the new library.",
    "Water expands when it freezes, which is why pipes burst in winter and why ice floats on the surface of lakes.",
    "Give three reasons why a slow client should not be allowed to hold up the other clients of a streaming server.",
    "She had learned to play the violin from her grandmother, who had learned it from a travelling musician in 1931.",
    "The quarterly report shows revenue growing by eight percent, while the cost of cloud computing grew by almost twenty.",
    "To bake bread at home you need flour, water, salt and yeast, and above all you need patience while the dough rises.",
    "Backpressure is the signal that travels upstream when a consumer cannot keep up, telling the producer to slow down.",
    "The museum's newest exhibit collects letters written by soldiers to their families during the long winter of the siege.",
    "Summarise the main idea of the theory of evolution by natural selection in a few clear sentences for a student.",
    "Every morning the fishing boats leave the harbour before dawn and return by noon with crates of mackerel and crab.",
    "A tokenizer turns text into integers, and an incremental decoder turns those integers back into text one piece at a time.",
    "The mountain path was steep and narrow, and the hikers stopped often to look back at the valley far below them.",
    "Write a polite email to a colleague asking for feedback on a design document before the meeting on Friday.",
    "Prime numbers have fascinated mathematicians for centuries, and some of the simplest questions about them remain unsolved.",
    "The engine releases a finished sequence's blocks in exactly one place, and a second release is treated as a bug.",
    "On the night of the storm, the power went out across the whole town, and people lit candles and told old stories.",
    "What are the trade-offs between server-sent events and WebSockets for sending live updates to a web page?",
    "The garden was overgrown with roses and ivy, and in the middle stood a stone fountain that had not worked in years.",
    "A careful experiment states its hypothesis, holds everything else constant, and says in advance what result would refute it.",
)


def cycle(n: int) -> list[str]:
    """``n`` prompts, the fixed ones in turn (beyond their number, again from the first)."""
    return [PROMPTS[i % len(PROMPTS)] for i in range(n)]


def context_ids(tokenizer: object, batch: int, context: int) -> list[list[int]]:
    """``batch`` different prompts of exactly ``context`` token ids each, cut from the prompts
    above run together (for engine measurements that need a fixed context)."""
    ids = list(tokenizer.encode(" ".join(PROMPTS)))  # type: ignore[attr-defined]
    if len(ids) < context + batch:
        raise ValueError(f"the prompts give {len(ids)} tokens: too few for {batch} contexts of {context}")
    return [ids[i : i + context] for i in range(batch)]
