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
# # 3. Overlapping streams: what batching buys, and what a single stream pays
#
# The same server answers 1, 2, 4, ... streams sent at the same moment, each on its own
# connection, and we measure from the client's side: the makespan (first request sent to last
# stream ended), the aggregate tokens per second, the time to first token and the gap between
# tokens. The baseline is the same prompts run one after another, summed.
#
# Three expectations, taken from the chapter and tested here: aggregate throughput grows nearly
# with the number of streams while each stream's gap grows much less; the wait for a first token rises
# with how many requests arrive at once, because their prefills run one after
# another; and a request that joins while others run waits for the step in progress and its
# own prefill, and no more.

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
from labkit.experiments import chapter, overlap
from labkit.experiments.results import save_run
from labkit.experiments.notebook import settings_table, setup_notebook
from labkit.experiments.progress import measuring

profile = setup_notebook(profile_name, model_name, notebook="03_overlap")
config = overlap.Config.for_profile(profile)
settings_table(config)

# %% [markdown]
# This cell runs four measurements in turn; the bar names each one as it starts.

# %%
# NBVAL_IGNORE_OUTPUT
with measuring(overlap, config, profile) as progress, labkit.serve_in_thread(**overlap.server_options(config)) as server:
    print(f"serving {server.engine.model.name} at {server.url}, batch limit {server.config.engine.max_batch}")
    tables = overlap.run(config, server=server, progress=progress)
elapsed = progress.elapsed_s

# %% [markdown]
# ## What must hold whatever the timings
#
# One line per invariant; it reads the same under any profile when the invariant holds.

# %%
# NBVAL_CHECK_OUTPUT
print(overlap.report(tables))

# %% [markdown]
# ## Levels
#
# Medians over the repetitions of each level. `back_to_back_s` is the sum of the same prompts'
# solo runs; `speedup` divides it by the makespan. Requests that arrive together are admitted in
# one step and prefilled one after another, and each first token is handed over as its own
# prefill ends; so an early stream's first gap (first token to second) also holds every later
# prefill of that step, which is what lifts the p99 gap at the larger levels.

# %%
# NBVAL_IGNORE_OUTPUT
tables['levels'].groupby('level').median(numeric_only=True).drop(columns='repetition')

# %% [markdown]
# ## Why the aggregate grows: the cost of a decode step
#
# The engine decodes every running sequence in one pass, so a step's cost is a fixed part plus a
# part per sequence. The line is fitted through the median step time (no prefill in it) at each
# batch size, measured on the served model beside a bare transformers forward.

# %%
# NBVAL_IGNORE_OUTPUT
tables['step_cost']

# %%
# NBVAL_IGNORE_OUTPUT
tables['step_fit']

# %% [markdown]
# ## Late joiners
#
# Short requests arrive at random moments while long streams are already decoding (every long
# stream has its first token before the first joiner is sent), and on an idle engine. The columns
# `background_running_*` confirm that the long streams were still running when each joiner was
# sent and when its first token came back; `joiners_running_at_send` counts the earlier joiners
# still running, since where a step is slow a short request lives long enough to overlap the
# next one even on an "idle" engine.

# %%
# NBVAL_IGNORE_OUTPUT
overlap.joiners_table(tables['joiners'])

# %%
# NBVAL_IGNORE_OUTPUT
tables["joiners"].groupby("background")[["background_running_at_send", "joiners_running_at_send"]].agg(["min", "max"])

# %% [markdown]
# ## First-token delivery: at the end of its own prefill, or at the end of the step
#
# Many requests arriving together are admitted in one step and prefilled one after another. If
# every first token waits for the step to end, all of them arrive when the last prefill is done;
# if each is handed over as soon as its own prefill is done, the early ones arrive sooner and the
# last one no later. The chapter delivered at step end and left the other as an exercise; the
# hub here does both (`first_token="prefill"` or `"step_end"`).

# %%
# NBVAL_IGNORE_OUTPUT
overlap.delivery_table(tables['delivery'])

# %%
# NBVAL_IGNORE_OUTPUT
figures = overlap.plot(tables)
written = save_run(overlap, config, profile, tables, elapsed, figures)
print("figures:", ", ".join(p.name for p in written["figures"]), "| results:", written["results"])

# %% [markdown]
# ## Beside the chapter
#
# The chapter's numbers come from a GPU, where a decode step is mostly fixed cost; on two CPU
# cores a step costs more and grows faster with the batch, so the ratios matter more than the
# absolute figures. The `full` profile runs the chapter's sizes (32 streams, 64 tokens).

# %%
# NBVAL_IGNORE_OUTPUT
chapter.overlap_beside(tables)

# %% [markdown]
# How to read it: the speedup over back-to-back serving is the direct measure of what overlap
# buys, and the fitted line says where it comes from: when the per-sequence part of a step is
# small against the fixed part, a step for many costs little more than a step for one. The price
# is paid by each stream in its gap between tokens and, for requests that arrive together, in
# the time to first token. A late joiner's first token should cost about the rest of one step
# of the batch it joins plus its own prefill. It may grow with the number of running streams only
# as far as that step grows with the batch (see the fitted line); growth beyond that would mean
# joiners queue behind one another.
