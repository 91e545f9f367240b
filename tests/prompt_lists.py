"""The prompt lists the tests share, defined once.

Tests index them (``PROMPTS[3]``) and compare runs of the same prompt, so each list keeps its
order; the helper modules hand them on as ``PROMPTS``.
"""
from __future__ import annotations

# Engine tests: sixteen short prompts of different lengths.
ENGINE_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The quick brown fox",
    "In 1969, the first humans",
    "Streaming responses over HTTP",
    "A paged KV cache stores",
    "Why is the sky blue? Because",
    "List three prime numbers:",
    "The meaning of life is",
    "Server-sent events are",
    "import numpy as np\n",
    "Dear Sir or Madam,",
    "Continuous batching lets",
    "Water boils at",
    "She opened the door and",
]

# Runner tests: ten prompts from one character to a sentence, checked against Hugging Face.
RUNNER_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "Water boils at",
    "My favourite colour is",
    "1, 2, 3, 4,",
    "The quick brown fox jumps over the lazy dog.",
    "In 1492, Columbus sailed",
    "A",
    "Streaming tokens over HTTP needs a framing such as server-sent events, because",
]

# Service tests: eight prompts, one per stream of a batch.
SERVICE_PROMPTS = ["The capital of France is", "Once upon a time,", "def fibonacci(n):", "The quick brown fox",
                   "Streaming responses over HTTP", "A paged KV cache stores", "Water boils at", "Dear Sir or Madam,"]
