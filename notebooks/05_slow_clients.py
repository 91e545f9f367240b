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
# N streams of a fixed number of tokens share the engine (`ignore_eos`, so every stream makes
# exactly that many), and k of their readers (0 or 1) are slow. Each token event carries an SSE
# comment of `pad_bytes` (the settings table below gives every size; they are settings, not
# findings), a laboratory device that makes a stream long enough to fill the buffers between
# server and client, which ordinary token events never do (notebook 04). Every policy of the hub
# has its own server, all on one loaded model:
#
# * `naive`: the engine's step loop hands each event over and waits until it is taken;
# * `unbounded`: per-stream queues without limit;
# * `pause`: a stream `high_water` events behind leaves the decode batch, keeping its slot and blocks;
# * `drop`: a stream `high_water` events behind for `stall_timeout` is cancelled with an `error` of type `slow_client`;
# * `pause_then_drop`: pause first, cancel a stream that stays paused for `stall_timeout`.
#
# Two differences from the chapter, stated plainly. Linux here grows a connection's send buffer
# by itself (notebook 04 measures how far), enough for a whole padded stream, so no policy would
# see a slow reader: the server's `SO_SNDBUF` is capped (`server_sndbuf`). And "slow" is relative
# to how fast this machine writes: a first run with nobody slow (a warm-up, not counted) measures
# the rate a reader that keeps up is written to, and the slow reader is paced at `slow_fraction`
# of it. Every run then records the rate the slow reader actually read at; divided by its
# policy's write rate (the median of that server's own k = 0 runs) it is the achieved ratio.
#
# The runs go policy by policy and k by k, repetition after repetition (A B C …, A B C …), so each
# policy is compared with its own k = 0 runs, measured in between. A slow reader leaves (RST)
# shortly after the last healthy stream has ended: by then its policy has done what it does.
#
# ## Hypotheses, and what would falsify them (stated before measuring)
#
# 1. `naive_delays_healthy`: under `naive`, one slow reader delays the healthy streams.
#    *Falsified if* their median completion with one slow reader is under 1.5 times their median
#    with none, or the two ranges overlap.
# 2. `queues_isolate_healthy`: with a queue per stream (`unbounded`, `pause`, `drop`,
#    `pause_then_drop`) a slow reader does not delay the healthy streams. *Falsified if*, for any
#    of them, the healthy median completion with one slow reader is above 1.25 times its own
#    median with none.
# 3. `same_steps`: whatever the policy, a slow reader costs the healthy streams seconds, never
#    engine steps. *Falsified if* for any policy the healthy streams' median finishing step (counted
#    from the run's first step) moves by more than 2 steps from k = 0.
# 4. `policies_act`: with one slow reader, `pause` pauses it, and `drop` and `pause_then_drop`
#    drop it, in every run. *Falsified by* any such run in which the policy did not act.
# 5. `slow_is_slow`: the slow reader reads at most half of what the same server writes.
#    *Falsified by* any run whose achieved ratio is above 0.5.

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
from labkit.experiments import slowclient
from labkit.experiments.readings import quiet_line, verdict_lines, verdict_table
from labkit.experiments.results import save_run
from labkit.experiments.notebook import settings_table, setup_notebook
from labkit.experiments.progress import measuring

profile = setup_notebook(profile_name, model_name, notebook="05_slow_clients")
config = slowclient.Config.for_profile(profile)
settings_table(config)

# %% [markdown]
# The notebook's server is the first policy's; the experiment starts one more server per
# policy on the same model, all of them at once, and stops them all at the end.

# %%
# NBVAL_IGNORE_OUTPUT
with measuring(slowclient, config, profile) as progress, labkit.serve_in_thread(**slowclient.server_options(config)) as server:
    print(f"serving {server.engine.model.name} at {server.url}, batch limit {server.config.engine.max_batch}")
    tables = slowclient.run(config, server=server, progress=progress)
elapsed = progress.elapsed_s

# %%
# NBVAL_IGNORE_OUTPUT
print(quiet_line(progress.machine))

# %% [markdown]
# ## Every server afterwards

# %%
# NBVAL_CHECK_OUTPUT
print(slowclient.report(tables))

# %% [markdown]
# ## How slow the slow reader was
#
# The warm-up run's write rate and the pace it set. Look at `slow_ratio` in the tables below: the
# rate the slow reader achieved in each run over its policy's k = 0 write rate.

# %%
# NBVAL_IGNORE_OUTPUT
tables['pace']

# %% [markdown]
# ## Who pays
#
# One row per policy and number of slow readers, over the repetitions: the last healthy stream's
# completion in seconds and in engine steps (median, min, max), the mean time between steps,
# the slow reader's achieved ratio, and in how many runs the policy paused or dropped it.
# `done_vs_k0` and `steps_vs_k0` set each row beside the same policy's k = 0 runs.

# %%
# NBVAL_IGNORE_OUTPUT
tables['compare']

# %% [markdown]
# Every run, in the order it was measured:

# %%
# NBVAL_IGNORE_OUTPUT
tables['runs']

# %%
# NBVAL_IGNORE_OUTPUT
figures = slowclient.plot(tables)
written = save_run(slowclient, config, profile, tables, elapsed, figures, machine=progress.machine)
print("figures:", ", ".join(p.name for p in written["figures"]), "| results:", written["results"])

# %% [markdown]
# ## Verdicts

# %%
# NBVAL_IGNORE_OUTPUT
verdict_table(slowclient.verdicts(tables))

# %% [markdown]
# The verdicts that hold under both profiles (the tiny test model and SmolLM2), checked on
# every test run:

# %%
# NBVAL_CHECK_OUTPUT
print(verdict_lines(slowclient.checked(tables)))

# %%
# NBVAL_IGNORE_OUTPUT
display(Markdown(slowclient.findings(tables)))

# %% [markdown]
# ## Beside the chapter

# %%
# NBVAL_IGNORE_OUTPUT
slowclient.beside_chapter(tables)

# %% [markdown]
# Reading the tables: compare each policy's k = 1 row with its own k = 0 row, never with
# another policy's. Under `naive` the healthy streams finish after as many steps as with nobody
# slow, but the steps are further apart: the step loop waits for the slow reader between them.
# The other policies differ in who carries the slow reader's backlog: `unbounded` keeps it in
# memory (`slow_max_queue` in the runs table), `pause` keeps the sequence, its slot and its
# blocks until the reader catches up (what that costs when the batch is full is measured in
# notebook 07), and `drop` and `pause_then_drop` give the slot back and tell the slow client
# with an `error` event after what was already sent.
