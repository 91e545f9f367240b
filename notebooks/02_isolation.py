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
# # 2. Isolation: does a stream's answer depend on its neighbours?
#
# A batch decodes many sequences in one pass, and nothing in the arithmetic should let one row
# see another. But padding, tiling and the shape of a matrix product can change the order of a
# floating-point sum, and a different order can flip a near tie between two tokens. So we test
# it: each prompt is streamed alone first, then the first N prompts are streamed at once, N from
# 1 up, several times, and every concurrent stream is compared token id by token id with its
# solo run. The engine computes its decode on fixed tiles of rows by default
# (`batch_invariant=True`), which is meant to make the comparison exact; here it is checked end
# to end, over HTTP, with greedy decoding.

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
from labkit.experiments import chapter, isolation
from labkit.experiments.results import save_run
from labkit.experiments.notebook import settings_table, setup_notebook
from labkit.experiments.progress import measuring

profile = setup_notebook(profile_name, model_name, notebook="02_isolation")
config = isolation.Config.for_profile(profile)
settings_table(config)

# %%
# NBVAL_IGNORE_OUTPUT
with measuring(isolation, config, profile) as progress, labkit.serve_in_thread(**isolation.server_options(config)) as server:
    print(f"serving {server.engine.model.name} at {server.url}, batch limit {server.config.engine.max_batch}")
    tables = isolation.run(config, server=server, progress=progress)
elapsed = progress.elapsed_s

# %% [markdown]
# ## The invariant

# %%
# NBVAL_CHECK_OUTPUT
print(isolation.report(tables))

# %%
# NBVAL_IGNORE_OUTPUT
tables['levels']

# %% [markdown]
# Where a stream differs, the table below gives the first position where it left its solo run,
# the two tokens, and the reference model's logit margin between them (plain transformers, one
# sequence, no batch). A margin near zero means a near tie broken the other way; a large one
# would point to a bug. An empty table means there was nothing to explain.

# %%
# NBVAL_IGNORE_OUTPUT
streams = tables["streams"]
streams.loc[~streams.identical, ["level", "repetition", "prompt", "first_diff", "solo_token",
                                 "concurrent_token", "margin", "top2_margin"]]

# %%
# NBVAL_IGNORE_OUTPUT
figures = isolation.plot(tables)
written = save_run(isolation, config, profile, tables, elapsed, figures)
print("figures:", ", ".join(p.name for p in written["figures"]), "| results:", written["results"])

# %% [markdown]
# ## Beside the chapter

# %%
# NBVAL_IGNORE_OUTPUT
chapter.isolation_beside(tables)

# %% [markdown]
# The result covers greedy decoding in float32 on this engine and nothing more. Sampling with a
# per-request seed and lower precision are separate questions, taken up in notebook 07, where a
# divergence is reported the same way: first differing position and margin.
