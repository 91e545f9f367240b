# ---
# jupyter:
#   jupytext:
#     cell_metadata_filter: tags,-all
#     notebook_metadata_filter: kernelspec,jupytext,-jupytext.text_representation.jupytext_version
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: streamlab (labkit)
#     language: python
#     name: streamlab
# ---

# %% [markdown]
# # 1. What goes over the wire
#
# A streamed answer is one HTTP response whose body keeps growing. Here every prompt is sent twice to the
# same server: once to `POST /v1/stream`, read event by event with a timed SSE reader, and
# once to `POST /v1/generate`, which answers with a single JSON document. For each stream we
# check what a client leans on (the content type, the request id in the header against the
# one in the `start` event, the order start, tokens, done, the same tokens, text, usage and
# finish reason as the JSON answer, a last event id that matches the count of events, nothing
# cut off at the end) and we count what the stream cost in bytes.

# %% tags=["parameters"]
# Parameters: papermill replaces this cell's values (`papermill -p profile_name ci`).
# "full": SmolLM2-135M at the chapter's sizes; "ci": the tiny random GPT-2, a test run.
# LABKIT_PROFILE in the environment that started Jupyter overrides the default.
import os

profile_name = os.environ.get("LABKIT_PROFILE", "full")
model_name = ""  # "" runs the profile's model

# %%
# NBVAL_IGNORE_OUTPUT
import labkit
from labkit.experiments import chapter, wire
from labkit.experiments.results import save_run
from labkit.experiments.notebook import settings_table, setup_notebook
from labkit.experiments.progress import measuring

profile = setup_notebook(profile_name, model_name, notebook="01_wire_format")
config = wire.Config.for_profile(profile)
settings_table(config)

# %% [markdown]
# The server runs in a background thread for the length of the next cell and is stopped when it ends.

# %%
# NBVAL_IGNORE_OUTPUT
with measuring(wire, config, profile) as progress, labkit.serve_in_thread(**wire.server_options(config)) as server:
    print(f"serving {server.engine.model.name} at {server.url}, batch limit {server.config.engine.max_batch}")
    tables = wire.run(config, server=server, progress=progress)
elapsed = progress.elapsed_s

# %% [markdown]
# ## The checks
#
# One line per property. When every stream has it, the line reads the same under any profile;
# a failure would print how many streams broke it.

# %%
# NBVAL_CHECK_OUTPUT
print(wire.report(tables))

# %%
# NBVAL_IGNORE_OUTPUT
tables['checks']

# %% [markdown]
# ## What a stream costs
#
# Bytes per token counts the whole stream (start and done included) against its tokens. Most
# of it is the token events themselves: an `event:` line, an `id:` line and a small JSON object
# with the token's index, id and text. The figure's right panel shows one event's size by kind.

# %%
# NBVAL_IGNORE_OUTPUT
cols = ["prompt", "tokens", "events", "bytes", "bytes_per_token", "empty_deltas", "ttft_s", "duration_s"]
tables["streams"][cols].describe().loc[["min", "50%", "max"]]

# %%
# NBVAL_IGNORE_OUTPUT
figures = wire.plot(tables)
written = save_run(wire, config, profile, tables, elapsed, figures)
print("figures:", ", ".join(p.name for p in written["figures"]), "| results:", written["results"])

# %% [markdown]
# ## Beside the chapter
#
# The chapter ran this experiment with GPT-2 small on a GPU. Its wire cost does not depend on
# the hardware: it is set by the schema and by how long the ids and text of each token are, so
# ours should land near it, moved only by the tokenizer and the kind of text the model writes.

# %%
# NBVAL_IGNORE_OUTPUT
chapter.wire_beside(tables)

# %% [markdown]
# A stream that passes every check can be read by any client that follows the SSE rules: one
# `start`, the tokens in order, exactly one terminal event, and a last event id that says how
# many events arrived, which is what a reconnecting client sends back. Per-token cost is only
# compared over streams that ran to their limit: SmolLM2-Instruct, given a bare prompt rather
# than its chat template, ends a few answers at once with its end-of-sequence token, and such a
# stream spreads its `start` and `done` over one or two tokens. That closing token's event has
# no text and is not counted as an empty delta; a genuine empty delta would be a token holding
# only part of a character. At roughly seventy bytes a token, a few hundred tokens make a stream
# of tens of kilobytes; notebook 04 sets that against what the connection holds before a writer
# has to wait.
