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
# Five things the chapter argued or left as exercises, run on the lab's service:
#
# 1. first-token delivery when each prefill ends, against at the end of the step;
# 2. `pause_then_drop` under a full batch, at several stall timeouts, against `pause`;
# 3. resuming a stream with `Last-Event-ID` after its client dropped the connection;
# 4. the memory an eagerly formatting server would hold for four slow readers;
# 5. identity under sampling with per-request seeds, and under bfloat16, reported by first
#    divergence and the float32 model's logit margin there.

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
from labkit.experiments import extensions
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

# %% [markdown]
# ## What must hold exactly

# %%
# NBVAL_CHECK_OUTPUT
print(extensions.report(tables))

# %% [markdown]
# ## First-token delivery
#
# N requests arrive together; they are admitted in one step and prefilled one after another.

# %%
# NBVAL_IGNORE_OUTPUT
tables['delivery']

# %% [markdown]
# ## Pause, then drop, with the batch full
#
# Batch limit 4, two slow readers first, then fast requests. `pause` never lets go; each stall
# timeout of `pause_then_drop` trades slots held for slow clients cancelled.

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
# ## Eager formatting: memory held for four slow readers

# %%
# NBVAL_IGNORE_OUTPUT
tables['eager']

# %% [markdown]
# ## Identity under sampling and in bfloat16
#
# Where two runs split, `margin` is the float32 model's logit for the reference run's token
# minus the other's, after the tokens both share; `top2_margin` the gap between its best two.

# %%
# NBVAL_IGNORE_OUTPUT
tables['identity_summary']

# %%
# NBVAL_IGNORE_OUTPUT
tables['identity'].loc[~tables['identity'].identical]

# %%
# NBVAL_IGNORE_OUTPUT
figures = extensions.plot(tables)
written = save_run(extensions, config, profile, tables, elapsed, figures)
print("figures:", ", ".join(p.name for p in written["figures"]), "| results:", written["results"])

# %% [markdown]
# ## Beside the chapter

# %%
# NBVAL_IGNORE_OUTPUT
extensions.beside_chapter(tables)

# %% [markdown]
# Resumption costs the server a log of every event for as long as the grace period lasts, and
# it keeps the run going for a client that may never come back; the checked cell shows that
# what it replays is exact. Seeded sampling is as reproducible as greedy decoding here because
# each request owns its generator and the engine's batched arithmetic does not depend on the
# neighbours; bfloat16 is compared the same way, and where it departs from float32 the margin
# says whether a near tie was broken differently.
