"""The engine: a paged KV cache, a scheduler, a model runner and the step loop that drives them.

Nothing here imports asyncio, FastAPI or the hub, so the engine can be tested on its own.
"""
