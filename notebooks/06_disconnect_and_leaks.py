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
# generated that nobody read. The close → release time has two parts, and both are measured:
# the time until the server notices (the client's close → the hub's `close()`, on one clock),
# and the engine steps from that close to the release (a cancel takes effect at the engine's next
# step boundary). Token budgets and repetitions are in the settings table below; trials run four
# at a time, two repetitions with FIN and RST interleaved, which is exactly the batch limit.
#
# **Leak.** Many streams on a seeded plan; afterwards we inspect the server, not the responses
# (described where it runs, below).
#
# ## Hypotheses, and what would falsify each (stated before measuring)
#
# - **listening_releases_within_two_steps**: with Starlette's class the engine lets go of a
#   departed client's stream within 2 engine steps of the hub's close. Falsified if any trial
#   takes more.
# - **waiting_never_admitted**: a request whose client left while it waited for a slot is never
#   admitted (Starlette's class). Falsified if any such request is prefilled.
# - **write_only_runs_to_limit**: with the write-only class every abandoned stream is generated to
#   its token limit. Falsified if any ends earlier.
# - **fin_rst_alike_before_first**: how a client closes before its first token (FIN or RST) does
#   not change whether its request is admitted. Falsified if, in the same run, the shares of FIN
#   and RST clients that were admitted differ. (It depends on timing: data, not a check.)
# - **nothing_leaks**: after every client of the leak plan has come and gone, either response
#   class has given back every block, reservation and stream exactly once. Falsified if any check
#   of the books fails.
# - **listening_saves_work**: a response that listens generates fewer tokens per token its
#   leaving clients read than one that only writes. Falsified if Starlette's class generates at
#   least as many. (On the tiny model generation outruns the reader; data, not a check.)

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
from labkit.experiments.readings import quiet_line, verdict_lines, verdict_table
from IPython.display import Markdown, display

profile = setup_notebook(profile_name, model_name, notebook="06_disconnect_and_leaks")
config = disconnect.Config.for_profile(profile)
settings_table(config)

# %%
# NBVAL_IGNORE_OUTPUT
with measuring(disconnect, config, profile) as progress, labkit.serve_in_thread(**disconnect.server_options(config)) as server:
    print(f"serving {server.engine.model.name} at {server.url}, batch limit {server.config.engine.max_batch}")
    tables = disconnect.run(config, server=server, progress=progress)
elapsed = progress.elapsed_s
print(quiet_line(progress.machine))

# %% [markdown]
# ## The books after each server

# %%
# NBVAL_CHECK_OUTPUT
print(disconnect.report(tables))

# %% [markdown]
# Per moment and way of leaving. `hub_close_ms` runs from the client's close to the hub's
# `close()` (the server noticed), `release_ms` to the engine's finish event for the stream, and
# `release_steps` counts engine steps from the hub's close to the release (1: the next step
# boundary; 0 or less: the stream had already ended by itself, as write-only streams do before
# their hub closes); `ever_admitted` counts streams that ever got a slot.

# %%
# NBVAL_IGNORE_OUTPUT
tables['by_moment']

# %% [markdown]
# Clients that left before their first token, per way of leaving (Starlette's class): how many
# of their requests were admitted (prefilled) anyway.

# %%
# NBVAL_IGNORE_OUTPUT
disconnect.fin_rst_admitted(tables["trials"])

# %% [markdown]
# In the figures, look first at *When the server noticed*: the time from the client's close to
# the hub's close, for every trial; then at the release in steps beside it.

# %%
# NBVAL_IGNORE_OUTPUT
figures = disconnect.plot(tables)
written = save_run(disconnect, config, profile, tables, elapsed, figures, machine=progress.machine)
print("figures:", ", ".join(p.name for p in written["figures"]), "| results:", written["results"])

# %%
# NBVAL_IGNORE_OUTPUT
disconnect_verdicts = disconnect.verdicts(tables)
display(Markdown(disconnect.findings(tables)))
verdict_table(disconnect_verdicts)

# %% [markdown]
# **Leak.** Many streams from many concurrent clients on a seeded plan whose shares are settings,
# not measurements: 35% read to the end, half leave early by FIN or RST, 15% read slowly and
# leave after a few tokens. The counts, the batch limit and the token budgets are in the settings printed below.
# Afterwards we inspect the server, not the responses.

# %%
# NBVAL_IGNORE_OUTPUT
from labkit.experiments import leak

leak_config = leak.Config.for_profile(profile)
display(settings_table(leak_config))
with measuring(leak, leak_config, profile) as progress, labkit.serve_in_thread(**leak.server_options(leak_config)) as server:
    leak_tables = leak.run(leak_config, server=server, progress=progress)
leak_elapsed = progress.elapsed_s
print(quiet_line(progress.machine))

# %%
# NBVAL_CHECK_OUTPUT
print(leak.report(leak_tables))

# %%
# NBVAL_IGNORE_OUTPUT
leak_tables['outcome']

# %%
# NBVAL_IGNORE_OUTPUT
leak_figures = leak.plot(leak_tables)
written = save_run(leak, leak_config, profile, leak_tables, leak_elapsed, leak_figures, machine=progress.machine)
print("figures:", ", ".join(p.name for p in written["figures"]), "| results:", written["results"])

# %% [markdown]
# The `full` profile runs the chapter's number of streams, made short and run many at once so
# that both response classes fit the notebook's time (the settings table above has the sizes).
# Each class ran once: compare their times in engine steps as well as seconds.

# %%
# NBVAL_IGNORE_OUTPUT
leak_verdicts = leak.verdicts(leak_tables)
verdict_table(leak_verdicts)

# %% [markdown]
# ## Verdicts
#
# The verdicts that must hold on any machine and model (checked by CI); the others are in the
# tables above.

# %%
# NBVAL_CHECK_OUTPUT
print(verdict_lines([v for v in disconnect_verdicts if v.name in disconnect.CHECKED]
                    + [v for v in leak_verdicts if v.name in leak.CHECKED]))

# %% [markdown]
# ## Beside the chapter

# %%
# NBVAL_IGNORE_OUTPUT
disconnect.beside_chapter(tables)

# %%
# NBVAL_IGNORE_OUTPUT
leak.beside_chapter(leak_tables)

# %%
# NBVAL_IGNORE_OUTPUT
display(Markdown(leak.findings(leak_tables)))

# %% [markdown]
# What to read in the two experiments together: the verdicts above say whether, with a response
# that listens, a client's departure reached the engine within two steps and a waiting request
# was never admitted, and whether either class left anything behind; the findings say what the
# write-only class cost in work (tokens generated per token read, engine steps, time) for the
# same plan. The checks are the part worth copying: they look at the cache, the registered
# streams and the number of releases, not only at whether the server still answers.
