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
# # 5. A client that cannot keep up
#
# Eight streams of 64 tokens share the engine, and k of their readers (0, 1, 2 or 4) are slow:
# after every read of at most 64 KiB they sleep a quarter of a second. Each token event carries
# a 64 KiB SSE comment (these sizes and sleeps are settings), a laboratory device that makes one
# stream megabytes long, because ordinary token events (notebook 01 measures their size) never
# fill the buffers between server and client (notebook 04). Every policy of the hub is run on its own server, all on one loaded model:
#
# * `naive`: the engine's step loop hands each event over and waits until it is taken;
# * `unbounded`: per-stream queues without limit;
# * `pause`: a stream 8 events behind leaves the decode batch, keeping its slot and blocks;
# * `drop`: a stream 8 events behind for 0.25 s is cancelled with an `error` of type `slow_client`;
# * `pause_then_drop`: pause first, cancel a stream that stays paused for 0.25 s.
#
# One difference from the chapter, stated plainly: Linux here lets a connection's send buffer
# grow by itself (notebook 04 measures how far), enough for a whole padded stream, so no policy
# would ever see a slow reader. The main runs cap the server's `SO_SNDBUF` at 256 KiB (the
# service's `sndbuf` setting, near what the chapter reports its machine absorbed); one extra run,
# marked `linux`,
# keeps the kernel's own sizing.
#
# A second difference: "slow" is relative to how fast the engine writes. The chapter's GPU
# wrote far faster than its reader read (by the chapter's account); two CPU cores write 64 KiB
# events at a rate near what the chapter's reader takes. So after the first run, in which
# nobody is slow, the slow reader's reads are made smaller if needed, so that it takes at most
# half of what the server wrote to each reader; the sleep stays at 0.25 s. The `pace` table
# says what was measured and used.

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
from labkit.experiments import slowclient
from labkit.experiments.results import save_run
from labkit.experiments.notebook import settings_table, setup_notebook
from labkit.experiments.progress import measuring

profile = setup_notebook(profile_name, model_name, notebook="05_slow_clients")
config = slowclient.Config.for_profile(profile)
settings_table(config)

# %% [markdown]
# The notebook's server is the first policy's; the experiment starts one more server per
# policy, and each is stopped before the next starts. Most of the time goes to waiting for the
# slow readers (the expected duration is in the first table).

# %%
# NBVAL_IGNORE_OUTPUT
with measuring(slowclient, config, profile) as progress, labkit.serve_in_thread(**slowclient.server_options(config)) as server:
    print(f"serving {server.engine.model.name} at {server.url}, batch limit {server.config.engine.max_batch}")
    tables = slowclient.run(config, server=server, progress=progress)
elapsed = progress.elapsed_s

# %% [markdown]
# ## Every server afterwards

# %%
# NBVAL_CHECK_OUTPUT
print(slowclient.report(tables))

# %%
# NBVAL_IGNORE_OUTPUT
tables['pace']

# %% [markdown]
# ## Who pays
#
# One row per policy and number of slow readers: when the last healthy stream ended, its worst
# p99 gap between tokens, when the slow streams' sequences left the engine (the engine's own
# timestamps), when the slow clients finished reading and how their streams ended.

# %%
# NBVAL_IGNORE_OUTPUT
tables['grid']

# %% [markdown]
# ## A full batch
#
# With a batch limit of 4, two slow readers take slots first and six fast requests arrive
# behind them. The sampled engine state says how many slots paused streams held while others
# waited (in slot-seconds), and what that cost the fast requests.

# %%
# NBVAL_IGNORE_OUTPUT
tables['saturation']

# %% [markdown]
# ## The memory an eager server would hold
#
# The lab's hub queues unformatted events and builds the padding as each one is written. A
# server that built each event's bytes up front would keep every queued event at its full size. Under
# `unbounded`, the peak number of events queued at once (sampled at a fixed interval, a setting) times the
# measured size of one event gives that memory; `bound_bytes` is the arithmetic ceiling,
# every token of every slow stream, and `unread_at_release_bytes` what the slow clients had
# still to read when their sequences left the engine (queue and kernel together).

# %%
# NBVAL_IGNORE_OUTPUT
tables['eager']

# %%
# NBVAL_IGNORE_OUTPUT
figures = slowclient.plot(tables)
written = save_run(slowclient, config, profile, tables, elapsed, figures)
print("figures:", ", ".join(p.name for p in written["figures"]), "| results:", written["results"])

# %% [markdown]
# ## Beside the chapter

# %%
# NBVAL_IGNORE_OUTPUT
slowclient.beside_chapter(tables)

# %%
# NBVAL_IGNORE_OUTPUT
print(slowclient.findings(tables, config))

# %% [markdown]
# Reading the tables: only `naive` makes healthy streams wait for a slow one, because its step
# loop cannot move on until a reader takes an event; the other policies keep the healthy
# streams at their k = 0 pace and differ in who carries the slow reader's backlog. `unbounded`
# lets the sequence finish and leaves the backlog in memory; `pause` keeps the sequence, its
# slot and its blocks until the reader catches up, which is what the full-batch table charges
# to the fast requests; `drop` and `pause_then_drop` give the slot back quickly and the slow
# client learns it from an `error` event after reading what was already sent. The `linux` row
# is the caution: with the kernel's own buffer sizes the backlog sits in the kernel and even
# the naive server does not notice the slow reader.
