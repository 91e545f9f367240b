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
# # 6. When the client goes away
#
# A streamed request lives on after the handler that began it returns, so something must notice
# that its client has gone and give back what the request holds. Two experiments.
#
# **Disconnect.** A client leaves by FIN (an orderly close) or by RST (an abortive one) at five
# moments: while its request waits for a slot (the batch limit is 4 and four other streams
# fill it), right after the response headers, after 2 tokens, half-way and 4 tokens before the
# end. Two servers differ only in their response class: Starlette's `StreamingResponse`, which
# listens for the disconnect and cancels the body, and a write-only class that never listens,
# as Starlette's own behaves on servers speaking ASGI 2.4. We measure the time from the
# client's close to the engine's release of the stream's blocks, on one clock, and the tokens
# generated that nobody read. Each stream asks for 48 tokens (the chapter's 200 would make
# every write-only trial four times longer on two CPU cores); trials run four at a time,
# two repetitions with FIN and RST, which is exactly the batch limit.

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
from labkit.experiments import disconnect
from labkit.experiments.results import save_run
from labkit.experiments.notebook import settings_table, setup_notebook
from labkit.experiments.progress import measuring

profile = setup_notebook(profile_name, model_name, notebook="06_disconnect_and_leaks")
config = disconnect.Config.for_profile(profile)
settings_table(config)

# %%
# NBVAL_IGNORE_OUTPUT
with measuring(disconnect, config, profile) as progress, labkit.serve_in_thread(**disconnect.server_options(config)) as server:
    print(f"serving {server.engine.model.name} at {server.url}, batch limit {server.config.engine.max_batch}")
    tables = disconnect.run(config, server=server, progress=progress)
elapsed = progress.elapsed_s

# %% [markdown]
# ## The books after each server

# %%
# NBVAL_CHECK_OUTPUT
print(disconnect.report(tables))

# %% [markdown]
# Per moment and way of leaving. `release_ms` runs from the client's close to the engine's
# finish event for the stream; `ever_admitted` counts streams that ever got a slot, which for
# the `waiting` moment should be none with Starlette's class.

# %%
# NBVAL_IGNORE_OUTPUT
tables['by_moment']

# %%
# NBVAL_IGNORE_OUTPUT
figures = disconnect.plot(tables)
written = save_run(disconnect, config, profile, tables, elapsed, figures)
print("figures:", ", ".join(p.name for p in written["figures"]), "| results:", written["results"])

# %% [markdown]
# **Leak.** Many streams from up to 48 concurrent clients, batch limit 8, on a seeded plan (its shares are settings): 35%
# read to the end, half leave after 0 to 40 tokens by FIN or RST, 15% read slowly and leave
# after 3 or 10 tokens. Afterwards we inspect the server, not the responses.

# %%
# NBVAL_IGNORE_OUTPUT
from labkit.experiments import leak

leak_config = leak.Config.for_profile(profile)
print(f"{leak_config.streams} streams per response class")
with measuring(leak, leak_config, profile) as progress, labkit.serve_in_thread(**leak.server_options(leak_config)) as server:
    leak_tables = leak.run(leak_config, server=server, progress=progress)
leak_elapsed = progress.elapsed_s

# %%
# NBVAL_CHECK_OUTPUT
print(leak.report(leak_tables))

# %%
# NBVAL_IGNORE_OUTPUT
leak_tables['outcome']

# %%
# NBVAL_IGNORE_OUTPUT
leak_figures = leak.plot(leak_tables)
written = save_run(leak, leak_config, profile, leak_tables, leak_elapsed, leak_figures)
print("figures:", ", ".join(p.name for p in written["figures"]), "| results:", written["results"])

# %% [markdown]
# The `full` profile runs 150 streams per response class, not the chapter's 300: on two CPU
# cores every prefill costs about a tenth of a second, and 300 streams twice would take longer
# than the whole of this notebook is allowed.
#
# ## Beside the chapter

# %%
# NBVAL_IGNORE_OUTPUT
disconnect.beside_chapter(tables)

# %%
# NBVAL_IGNORE_OUTPUT
print(disconnect.findings(tables))

# %%
# NBVAL_IGNORE_OUTPUT
leak.beside_chapter(leak_tables)

# %%
# NBVAL_IGNORE_OUTPUT
print(leak.findings(leak_tables))

# %% [markdown]
# What the two experiments say together: with a response that listens, a client's departure
# reaches the engine within about a step, and a request that was still waiting is never
# admitted. With a response that only writes, nothing leaks either, because every abandoned
# sequence finishes by itself and is released once; what it costs is the work, measured as
# tokens generated per token read and as the total time for the same plan. The checks are the
# part worth copying: they look at the cache, the registered streams and the number of
# releases, not only at whether the server still answers.
