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
# # 4. Where backpressure begins
#
# Between the engine and a reader sit several buffers the application never sees: uvicorn's
# write buffer, the server's socket send buffer and the client's receive buffer. A client that
# connects, sends its request and then reads nothing shows how much they hold together. The
# server writes SSE events of a fixed size as fast as the connection takes them and times every
# write; the first write that does not return within the block threshold marks where the writer
# had to wait. Event sizes (settings, not measurements): about an ordinary token event, then
# 1 KiB, 16 KiB and 64 KiB, repeated in the order A B C D, A B C D, … The kernel's own limits
# (`net.ipv4.tcp_wmem` and `tcp_rmem`) are read from `/proc` in the same run and drawn as
# reference lines; one ordinary token stream is read to the end to turn bytes into tokens.
#
# ## Hypotheses, and what would falsify each (stated before measuring)
#
# - **every_flood_blocks**: a client that reads nothing makes the server's write block once the
#   buffers are full. Falsified if any flood ends, or times out, without a blocked write.
# - **server_finishes_after_leave**: after the client leaves by RST the server ends the response.
#   Falsified if any response is still unfinished at the timeout.
# - **bounded_by_the_kernel**: what the path absorbs is at most the kernel's largest send buffer
#   (`tcp_wmem` max) plus the client's receive buffer, the server transport's high-water mark and
#   one event. Falsified if any flood accepted more.
# - **send_buffer_grows**: the server's side holds more than the kernel's default send buffer
#   (`tcp_wmem` default): Linux grows it while data waits. Falsified if any flood's bytes on the
#   server's side (accepted minus what sat in the client) are at most that default.
# - **bytes_not_events**: the buffers hold bytes, not events: the amount absorbed hardly depends
#   on the event size. Falsified if the medians of two event sizes differ by more than 1.5×
#   (the criterion, fixed before measuring).

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
from labkit.experiments import chapter, buffers
from labkit.experiments.results import save_run
from labkit.experiments.notebook import settings_table, setup_notebook
from labkit.experiments.progress import measuring
from labkit.experiments.readings import quiet_line, verdict_lines, verdict_table
from IPython.display import Markdown, display

profile = setup_notebook(profile_name, model_name, notebook="04_buffers")
config = buffers.Config.for_profile(profile)
settings_table(config)

# %%
# NBVAL_IGNORE_OUTPUT
with measuring(buffers, config, profile) as progress, labkit.serve_in_thread(**buffers.server_options(config)) as server:
    print(f"serving {server.engine.model.name} at {server.url}, batch limit {server.config.engine.max_batch}")
    tables = buffers.run(config, server=server, progress=progress)
elapsed = progress.elapsed_s
print(quiet_line(progress.machine))

# %%
# NBVAL_CHECK_OUTPUT
print(buffers.report(tables))

# %%
# NBVAL_IGNORE_OUTPUT
tables['by_size']

# %% [markdown]
# `client_unread` is what sat in the client's own receive buffer when the writer blocked, read
# with `FIONREAD`; the rest of what was accepted waited on the server's side. The kernel's limits
# on those buffers (minimum, default, maximum, in bytes) bound the answer:

# %%
# NBVAL_IGNORE_OUTPUT
tables['kernel']

# %%
# NBVAL_IGNORE_OUTPUT
figures = buffers.plot(tables)
written = save_run(buffers, config, profile, tables, elapsed, figures, machine=progress.machine)
print("figures:", ", ".join(p.name for p in written["figures"]), "| results:", written["results"])

# %% [markdown]
# ## Beside the chapter

# %%
# NBVAL_IGNORE_OUTPUT
chapter.buffers_beside(tables)

# %% [markdown]
# ## Verdicts
#
# The chapter's figure came from its own machine (see the table above); on Linux the answer is a
# property of the kernel's settings, not of the application, so read it against the reference
# lines. Then ask what it means in tokens: how many ordinary token events fit before a writer
# blocks, and how many of the largest events of this run (a size set above, not measured) — the
# kind of padded event that makes a slow reader felt in notebook 05.

# %%
# NBVAL_IGNORE_OUTPUT
verdicts = buffers.verdicts(tables)
display(Markdown(buffers.findings(tables)))
verdict_table(verdicts)

# %% [markdown]
# The verdicts that hold on any model (the kernel is the same under every profile; checked by CI):

# %%
# NBVAL_CHECK_OUTPUT
print(verdict_lines(v for v in verdicts if v.name in buffers.CHECKED))
