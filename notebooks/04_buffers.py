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
# had to wait. Event sizes (settings, not measurements): an ordinary token event, then 1 KiB, 16 KiB
# and 64 KiB.

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

profile = setup_notebook(profile_name, model_name, notebook="04_buffers")
config = buffers.Config.for_profile(profile)
settings_table(config)

# %%
# NBVAL_IGNORE_OUTPUT
with measuring(buffers, config, profile) as progress, labkit.serve_in_thread(**buffers.server_options(config)) as server:
    print(f"serving {server.engine.model.name} at {server.url}, batch limit {server.config.engine.max_batch}")
    tables = buffers.run(config, server=server, progress=progress)
elapsed = progress.elapsed_s

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
written = save_run(buffers, config, profile, tables, elapsed, figures)
print("figures:", ", ".join(p.name for p in written["figures"]), "| results:", written["results"])

# %% [markdown]
# ## Beside the chapter

# %%
# NBVAL_IGNORE_OUTPUT
chapter.buffers_beside(tables)

# %%
# NBVAL_IGNORE_OUTPUT
smallest = int(tables["by_size"].bytes_accepted_min.min())
for per_token in (75, 64 * 1024 + 75):
    print(f"at {per_token:,} bytes per token, {smallest:,} bytes hold about {smallest // per_token:,} tokens")

# %% [markdown]
# The chapter found about a quarter to a third of a megabyte on its machine; Linux grows a
# socket's send buffer on its own (up to the `tcp_wmem` maximum) while data is queued, so on
# this stack the figure is a property of the kernel's settings, not of the application. Either
# way the consequence is the same: at seventy-odd bytes per token, a whole answer of a few
# hundred tokens fits in buffers long before a writer blocks, so a slow reader of ordinary token
# events never pushes back on the server. It takes large events, like the 64 KiB padding used in
# notebook 05, before a slow client is felt at all.
