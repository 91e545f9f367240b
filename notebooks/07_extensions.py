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
# # 7. Extensions: the chapter's exercises, measured
#
# Six things the chapter argued or left as exercises, the first five run on the lab's service
# (every size is a setting, in the settings tables below):
#
# 1. first-token delivery when each prefill ends, against at the end of the step, the two
#    servers taking turns, repetition after repetition;
# 2. `pause_then_drop` under a full batch, at several stall timeouts, against `pause`, with
#    interleaved repetitions;
# 3. resuming a stream with `Last-Event-ID` after its client dropped the connection;
# 4. the memory an eagerly formatting server would hold for slow readers: the peak queue of a
#    real run, formatted eagerly for real and measured with `tracemalloc`, beside the same
#    events held as the lab's hub holds them (unformatted);
# 5. identity under sampling with per-request seeds (against a repeat, against the solo runs, and
#    against the greedy streams, which they must differ from) and under bfloat16.
# 6. exercise 8: decode attention reading K and V through the block tables (a kernel) instead of
#    gathering each row's blocks into one copy per layer and step, timed against the gather on
#    one runner, at several contexts and batch sizes.
#
# ## Hypotheses, and what would falsify them (stated before measuring)
#
# 1. `sampling_takes_effect`: the sampled streams are not the greedy ones. *Falsified if* fewer
#    than half of them differ from the greedy streams (sampling silently ignored would make all
#    of them equal).
# 2. `seeded_sampling_repeats`: a seeded sampled stream repeats exactly, run again or run alone.
#    *Falsified by* any stream that differs between two runs with the same seed.
# 3. `eager_costs_memory`: formatting eagerly holds far more for slow readers than the lazy hub.
#    *Falsified if* the measured eager peak is under ten times the measured lazy one for the
#    same queued events.
# 4. `drop_frees_slots`: with the batch full, `pause_then_drop` at its shortest stall timeout holds
#    fewer slot-seconds for paused streams while requests wait than `pause`. *Falsified if* its
#    median is not below `pause`'s.
# 5. `prefill_delivery_is_earlier`: a first token delivered when its own prefill ends reaches the
#    client sooner than one delivered at the step's end. *Falsified if* the median over the
#    repetitions of the median first-token time is not lower at prefill.
# 6. `kernel_step_is_cheaper`: at 32 sequences the whole decode step costs less when attention
#    reads the blocks through the table than when it gathers them. *Falsified if*, at any context
#    measured, the kernel's median step time over the repetitions is not lower than the gather's.
# 7. `kernel_attention_is_cheaper`: the same for decode attention alone (every layer's, one step).
#    *Falsified if*, at any context measured, the kernel's median is not lower than the gather's.

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
from labkit.experiments import extensions
from labkit.experiments.readings import quiet_line, verdict_lines, verdict_table
from labkit.experiments.results import save_run
from labkit.experiments.notebook import settings_table, setup_notebook
from labkit.experiments.progress import measuring

profile = setup_notebook(profile_name, model_name, notebook="07_extensions")
config = extensions.Config.for_profile(profile)
settings_table(config)

# %%
# NBVAL_IGNORE_OUTPUT
with measuring(extensions, config, profile) as progress, labkit.serve_in_thread(**extensions.server_options(config)) as server:
    print(f"serving {server.engine.model.name} at {server.url}, batch limit {server.config.engine.max_batch}")
    tables = extensions.run(config, server=server, progress=progress)
elapsed = progress.elapsed_s

# %%
# NBVAL_IGNORE_OUTPUT
print(quiet_line(progress.machine))

# %% [markdown]
# ## What must hold exactly

# %%
# NBVAL_CHECK_OUTPUT
print(extensions.report(tables))

# %% [markdown]
# ## First-token delivery
#
# N requests arrive together; they are admitted in one step and prefilled one after another.
# Per mode: the median and the slowest first token of each repetition, over the repetitions.

# %%
# NBVAL_IGNORE_OUTPUT
tables['delivery']

# %% [markdown]
# ## Pause, then drop, with the batch full
#
# The batch limit is `slow.saturation_batch`; the slow readers take slots first, and once the
# server holds them paused the fast requests arrive. `pause` lets go only when a reader catches
# up; each stall timeout of `pause_then_drop` trades slots held for slow clients cancelled. Over
# the repetitions, then every run:

# %%
# NBVAL_IGNORE_OUTPUT
tables['saturation_summary']

# %%
# NBVAL_IGNORE_OUTPUT
tables['saturation']

# %% [markdown]
# ## Resuming after a dropped connection
#
# With `resumable: true` a stream's events go to a bounded log and the run survives its
# connection for a grace period. The client leaves by RST after N tokens, waits, and asks for
# the events after the last id it saw. The last row comes back after the grace period.

# %%
# NBVAL_IGNORE_OUTPUT
tables['resume']

# %% [markdown]
# ## Eager formatting: memory held for the slow readers
#
# `peak_queued_events` is the most events the hub held for the slow readers at once (sampled
# over `GET /stats`). Those events were then formatted as an eager server would format them
# (the service's own encoder, padding included) and held, and `tracemalloc` measured the peak:
# `eager_measured_mib`. `lazy_measured_mib` is the same measurement for the same events held as
# the hub holds them. `bound_mib` is arithmetic (every token of every slow stream), not measured.

# %%
# NBVAL_IGNORE_OUTPUT
tables['eager']

# %% [markdown]
# ## Identity under sampling and in bfloat16
#
# `differ` counts the streams that are not identical token for token. Where two runs split,
# `margin` is the float32 model's logit for the reference run's token minus the other's, after
# the tokens both share; `top2_margin` the gap between its best two.

# %%
# NBVAL_IGNORE_OUTPUT
tables['identity_summary']

# %%
# NBVAL_IGNORE_OUTPUT
tables['identity'].loc[~tables['identity'].identical]

# %%
# NBVAL_IGNORE_OUTPUT
figures = extensions.plot(tables)
written = save_run(extensions, config, profile, tables, elapsed, figures, machine=progress.machine)
print("figures:", ", ".join(p.name for p in written["figures"]), "| results:", written["results"])

# %% [markdown]
# ## Verdicts

# %%
# NBVAL_IGNORE_OUTPUT
verdict_table(extensions.verdicts(tables))

# %% [markdown]
# The verdicts that hold under both profiles (the tiny test model and SmolLM2), checked on
# every test run:

# %%
# NBVAL_CHECK_OUTPUT
print(verdict_lines(extensions.checked(tables)))

# %%
# NBVAL_IGNORE_OUTPUT
display(Markdown(extensions.findings(tables)))

# %% [markdown]
# ## Beside the chapter

# %%
# NBVAL_IGNORE_OUTPUT
extensions.beside_chapter(tables)

# %% [markdown]
# Resumption costs the server a log of every event for as long as the grace period lasts, and
# it keeps the run going for a client that may never come back; the checked cell shows that
# what it replays is exact. Seeded sampling is reproducible because each request owns its
# generator and the engine's batched float32 arithmetic does not depend on the neighbours; the
# comparison with the greedy streams is what shows that the sampling was done at all. bfloat16
# is compared the same way; where it departs from float32, the margin says whether a near tie
# was broken differently.

# %% [markdown]
# ## Exercise 8: reading the blocks through the table
#
# The paged decode's gather path copies every row's K and V blocks into one contiguous tensor,
# per layer and per step, and multiplies over the copy; the copy grows with context × batch.
# The paged kernel (`labkit/engine/kernels/paged_decode.cpp`) reads the blocks where they lie,
# through each row's block table, one (row, KV head) per task in an order set by that row's own
# length, so a row's numbers never depend on its neighbours. Both run on one runner (same
# weights, same pool, same scattered tables), the two modes and every cell interleaved over the
# repetitions, the pool filled with random keys and values so that no prompt needs prefilling.
# Hypotheses 6 and 7 above are judged here. Look for how far apart the two lines climb with
# context at 32 sequences, and whether the gap survives in the whole step.

# %%
# NBVAL_IGNORE_OUTPUT
from labkit.bench_attention import printable
from labkit.experiments import paged

paged_config = paged.Config.for_profile(profile)
settings_table(paged_config)

# %%
# NBVAL_IGNORE_OUTPUT
with measuring(paged, paged_config, profile) as paged_progress:
    paged_tables = paged.run(paged_config, progress=paged_progress)
print(quiet_line(paged_progress.machine))

# %% [markdown]
# What must hold exactly: the kernel changes no greedy token, and a row's logits decoded alone
# are bitwise those of the same row among neighbours.

# %%
# NBVAL_CHECK_OUTPUT
print(paged.report(paged_tables))

# %% [markdown]
# Per context and batch: each mode's median (min–max) over the repetitions, in ms per step, and
# the megabytes the gather copies per step (the kernel copies none).

# %%
# NBVAL_IGNORE_OUTPUT
printable(paged_tables['summary'])

# %%
# NBVAL_IGNORE_OUTPUT
paged_figures = paged.plot(paged_tables)
paged_written = save_run(paged, paged_config, profile, paged_tables, paged_progress.elapsed_s, paged_figures,
                         machine=paged_progress.machine)
print("figures:", ", ".join(p.name for p in paged_written["figures"]), "| results:", paged_written["results"])

# %% [markdown]
# The timing verdicts are not checked on every test run: under the tiny test model a step is
# mostly per-call overhead, and the comparison is a reading of this machine, not an invariant.

# %%
# NBVAL_IGNORE_OUTPUT
verdict_table(paged.verdicts(paged_tables))

# %%
# NBVAL_IGNORE_OUTPUT
display(Markdown(paged.findings(paged_tables)))
