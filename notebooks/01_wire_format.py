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
# A streamed answer is one HTTP response whose body keeps growing. First we look at the bytes
# themselves: one short stream captured on a plain socket, exactly as `curl --raw` would print
# it. Then every prompt is sent twice to the same server: once to `POST /v1/stream`, read event
# by event with a timed SSE reader, and once to `POST /v1/generate`, which answers with a single
# JSON document. For each stream we check what a client leans on (the content type, the request
# id in the header against the one in the `start` event, the order start, tokens, done, the same
# tokens, text, usage and finish reason as the JSON answer, a last event id that matches the
# count of events, nothing cut off at the end) and we count what the stream cost in bytes.
# Last, the awkward inputs a parser meets in the wild are fed to our parser and to httpx-sse.

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
from IPython.display import Markdown, display

from labkit.experiments import chapter, wire
from labkit.experiments.readings import quiet_line, verdict_lines, verdict_table
from labkit.experiments.results import save_run
from labkit.experiments.notebook import settings_table, setup_notebook
from labkit.experiments.progress import measuring

profile = setup_notebook(profile_name, model_name, notebook="01_wire_format")
config = wire.Config.for_profile(profile)
settings_table(config)

# %% [markdown]
# ## Hypotheses, before measuring
#
# Each is stated with what would falsify it; the verdicts at the end are computed from this run.
#
# 1. **Every stream keeps the client's contract.** Falsified if any check of the checks table
#    fails for any stream.
# 2. **Each event travels in an HTTP chunk of its own.** uvicorn writes each piece the service
#    yields as one chunk of the chunked body. Falsified if a chunk of the raw capture holds part
#    of an event, or more than one.
# 3. **Our parser follows the WHATWG rules on every awkward case.** Falsified if any case
#    dispatches other events than the rules prescribe.
# 4. **Where both follow the rules, our parser and httpx-sse dispatch the same events.**
#    Falsified if a case that both handle by the rules gives different events (handing the same
#    event out one read later is a difference in timing, listed, not in events).
# 5. **Token events carry most of a stream's bytes.** The start and done events are fixed costs
#    a long stream spreads over its tokens. Falsified if the median share of token-event bytes in
#    the streams that ran to their limit is below one half.

# %% [markdown]
# The server runs in a background thread for the length of the next cell and is stopped when it ends.

# %%
# NBVAL_IGNORE_OUTPUT
with measuring(wire, config, profile) as progress, labkit.serve_in_thread(**wire.server_options(config)) as server:
    print(f"serving {server.engine.model.name} at {server.url}, batch limit {server.config.engine.max_batch}")
    tables = wire.run(config, server=server, progress=progress)
elapsed = progress.elapsed_s

# %% [markdown]
# ## The wire, visible
#
# One stream of a few tokens, every byte the server sent, with `\r` and `\n` written out. Look
# for the HTTP head (its lines end in CRLF, then a blank line), then the chunked body: each chunk
# starts with its size in **hexadecimal** and a CRLF, then that many bytes, then a CRLF; a chunk
# of size `0` ends the body. Inside each chunk is one SSE event: `event:`, `id:` and `data:` lines
# ending in a bare LF, and the blank line that dispatches it.

# %%
# NBVAL_IGNORE_OUTPUT
print("\n".join(tables["raw"].line))

# %% [markdown]
# The same body taken apart by chunk: the size line as sent, its value, and the payload.

# %%
# NBVAL_IGNORE_OUTPUT
tables["raw_chunks"]

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
# ## Awkward input: our parser beside httpx-sse
#
# Each case is a few bytes, cut into reads (` | ` separates them) as a socket might deliver them,
# with the WHATWG rule it exercises. Both parsers are fed read by read; each event is shown with
# `@` the read after which it came out (`@end`: only when the stream ended). The last columns
# are computed: whether each parser dispatched what the rule prescribes, and where and why the
# two differ. Look at the BOM, the blank line injected into a payload (the rest of the payload
# is lost, which is why the lab's payloads are JSON, where a newline is always escaped), and the
# cases that end a read on a CR.

# %%
# NBVAL_IGNORE_OUTPUT
awkward_cols = ["case", "reads", "rule", "ours", "httpx-sse", "ours follows the rule",
                "httpx-sse follows the rule", "where and why"]
tables["awkward"][awkward_cols].style.hide(axis="index").set_properties(**{"text-align": "left"})

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
display(Markdown(wire.findings(tables)))

# %%
# NBVAL_IGNORE_OUTPUT
figures = wire.plot(tables)
written = save_run(wire, config, profile, tables, elapsed, figures, machine=progress.machine)
print("figures:", ", ".join(p.name for p in written["figures"]), "| results:", written["results"])

# %% [markdown]
# ## Beside the chapter
#
# The chapter ran this experiment with GPT-2 small on a GPU. Its wire cost does not depend on
# the hardware: it is set by the schema and by how long the ids and text of each token are, so
# the two should differ only by the tokenizer and the kind of text the model writes.

# %%
# NBVAL_IGNORE_OUTPUT
chapter.wire_beside(tables)

# %% [markdown]
# ## Verdicts
#
# The table gives each hypothesis, what would have falsified it and the evidence from this run;
# the checked lines below it carry no numbers, so they read the same under every profile while
# the effect holds.

# %%
# NBVAL_IGNORE_OUTPUT
verdict_table(wire.verdicts(tables))

# %%
# NBVAL_CHECK_OUTPUT
print(verdict_lines(wire.verdicts(tables)))

# %%
# NBVAL_IGNORE_OUTPUT
print(quiet_line(progress.machine))

# %% [markdown]
# A stream that passes every check can be read by any client that follows the SSE rules: one
# `start`, the tokens in order, exactly one terminal event, and a last event id that says how
# many events arrived, which is what a reconnecting client sends back. Per-token cost is only
# compared over streams that ran to their limit: a model may end an answer early with its
# end-of-sequence token (SmolLM2-Instruct, given a bare prompt rather than its chat template,
# does), and such a stream spreads its `start` and `done` over few tokens. That closing
# token's event has no text and is not counted as an empty delta; a genuine empty delta would be
# a token holding only part of a character. Notebook 04 sets a stream's size against what the
# connection holds before a writer has to wait.
