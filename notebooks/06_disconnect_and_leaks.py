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
# A streamed request outlives the handler that began it, so something must notice that its
# client has gone and give back what the request holds. The service's stream ends through one
# idempotent close (the hub's), which asks the engine to cancel; the engine applies a cancel at
# the following step boundary, and one function frees the blocks. Two response classes differ in
# whether anything notices: Starlette's `StreamingResponse` listens for the disconnect and
# cancels the body; the write-only class never listens, as Starlette's own behaves on servers
# that speak ASGI 2.4. Four measurements: when the server notices at five moments, FIN against
# RST in many pairs, whether a server stops generating (any target), and the leak test.

# %% tags=["parameters"]
# Parameters (papermill replaces these: `papermill -p profile_name ci`). "full": SmolLM2-135M at
# the notebook's sizes (each scale table says where they differ from the chapter's, and why); "ci": the tiny random GPT-2, a test run. LABKIT_PROFILE in the environment
# that started Jupyter sets the default. target_url "": labkit in a background thread; a URL: any
# OpenAI-compatible server (the measurements it cannot witness say so).
import os

profile_name = os.environ.get("LABKIT_PROFILE", "full")
model_name = ""
target_url = ""
device = "cpu"

# %%
# NBVAL_IGNORE_OUTPUT
from labkit.experiments import disconnect, leak
from labkit.lab import run, setup, target_for

profile = setup("06_disconnect_and_leaks", profile_name, model_name, device=device)
target = target_for(profile, target_url, device=device)
target

# %% [markdown]
# ## 1. Leaving at five moments
#
# Clients leave in pairs, one by FIN (an orderly close) and one by RST (an abortive one), side by
# side with the same prompt, at five moments: while their request waits for a slot (the batch,
# its limit read from `/stats`, is full of blockers that leave after them), right after the
# response head, after a couple of tokens, half-way, and just before the end. Each class has its
# own server. From the server's records, on the client's clock: the client's close, the hub's
# close (the server noticed) and the release of the blocks, in ms and in engine steps, and the
# tokens made that nobody read.
#
# * **listening releases within two steps**: with a listening response the engine releases a
#   departed client's stream within two steps of the hub's close. Falsified by any that takes
#   longer.
# * **waiting never admitted**: with a listening response, a request whose client left while it
#   waited for a slot is never admitted. Falsified by any that gets one. (The write-only class is
#   not judged here: it does not notice the departure, and the next criterion covers it.)
# * **write-only runs to the limit**: with the write-only class every abandoned stream is
#   generated to its token limit. Falsified by any that ends sooner.

# %%
# NBVAL_IGNORE_OUTPUT
moments = run(disconnect.MOMENTS, target)

# %%
# NBVAL_IGNORE_OUTPUT
moments.scale()

# %%
# NBVAL_IGNORE_OUTPUT
moments.table("by_moment")

# %% [markdown]
# Where the time from a client's close to the release goes, per class, moment and way of leaving
# (medians): `notice_ms` until the hub's close; `rest_of_step_ms`, what was left of the engine
# step in progress at that close (the cancel waits for the step boundary); `release_steps`, the
# steps from the close to the release; `step_ms`, the length of the step in progress. The parts
# add up to `explained_ms` (notice, the rest of the step, and any whole steps after it), to be
# read beside the measured `release_ms`. For the write-only class the release comes before the
# hub's close (in milliseconds; in steps the two fall in the same step, or one apart): the stream
# ran to its end, and only then did the hub close it.

# %%
# NBVAL_IGNORE_OUTPUT
moments.table("decomposition")

# %%
# NBVAL_IGNORE_OUTPUT
moments.verdict_table()

# %%
# NBVAL_CHECK_OUTPUT
print(moments.checked())

# %%
# NBVAL_IGNORE_OUTPUT
moments.plot();

# %% [markdown]
# ## 2. FIN against RST
#
# Does the way a client closes change how soon the server notices? Many pairs per moment, each a
# FIN client and an RST client leaving at the same point of a step: right after the head, or
# right after the same token event (which arrives right after a step ended). The waves run a few
# pairs at once, up to the batch limit. The effect is the paired difference, FIN minus RST, in
# the time from the client's close to the hub's close: its median with an interval (at the coverage fixed before measuring, which each verdict prints) (order
# statistics), and Wilcoxon's signed-rank test beside it.
#
# * **FIN and RST alike** (per moment): the two ways differ by less than an equivalence margin
#   fixed here, before measuring: a tenth of the server's median step among those that ran the
#   model (decoded or prefilled) in the moment's waves, because the engine acts on a close only at
#   a step boundary, so a difference well inside a step changes nothing it does. (Steps that only
#   apply cancels run no model and are not counted; where no wave of a moment ran the model, as
#   when every client leaves before admission, the moment takes every moment's step.)
#   Holds when the interval lies inside the margin; falsified when it lies wholly outside;
#   "unclear" while it crosses an edge. A count of admitted requests is not the criterion: such
#   counts differ by chance between small groups that behave alike.

# %%
# NBVAL_IGNORE_OUTPUT
fin_rst = run(disconnect.FIN_RST, target)

# %%
# NBVAL_IGNORE_OUTPUT
fin_rst.scale()

# %%
# NBVAL_IGNORE_OUTPUT
fin_rst.table("fin_rst")

# %%
# NBVAL_IGNORE_OUTPUT
fin_rst.verdict_table()

# %%
# NBVAL_IGNORE_OUTPUT
fin_rst.plot();

# %% [markdown]
# Read the interval against the margin, not the p-value alone: with many pairs a rank test finds
# a difference far smaller than anything the engine could act on, and the interval says how big
# it is. `fin_later` counts the pairs in which the FIN was noticed later.

# %% [markdown]
# ## 3. Does the server stop generating?
#
# The probe that runs against any target: streams read a few tokens, then all leave by FIN or
# RST. The witness is the best the target offers: its stream records (tokens made after the
# leave, over the tokens left), `/stats` or `/metrics` (requests running), its CPU time, else a
# follow-up request's pace; each read idle, while the streams run and after they left, and
# `kept_on` is the share of the rest the server still did (nothing: it stopped).
#
# * **stops** (a listening class): falsified by any usable round in which it kept on with half
#   the rest or more. **keeps generating** (the write-only class): falsified by any usable round
#   in which it did less. A round is not usable when the streams did not move the witness, or
#   would have ended within twice its window anyway.

# %%
# NBVAL_IGNORE_OUTPUT
stop = run(disconnect.STOP, target)
stop.table("rounds")

# %%
# NBVAL_IGNORE_OUTPUT
stop.scale()

# %%
# NBVAL_IGNORE_OUTPUT
stop.verdict_table()

# %%
# NBVAL_CHECK_OUTPUT
print(stop.checked())

# %% [markdown]
# ## 4. The leak test
#
# Many clients on a seeded plan whose shares are the chapter's: about a third read to the end,
# half leave early by FIN or RST after a drawn number of tokens, the rest read slowly and leave
# after a few. At most a fixed number are connected at once, on a batch limit smaller than that,
# so requests wait. Then the server's books, not the responses: with lab routes the cache check
# on the step thread, nothing held, running, waiting or registered, every stream finished once
# and every admitted one released once, no hub error; against a target without them `/stats` or
# `/metrics`, else the CPU or a follow-up's pace back to idle, the witness named in each row. The
# classes take turns, run after run.
#
# * **nothing leaks**: every check passes after every run of either class, and no client saw an
#   error. Falsified by any failure.
# * **listening saves work**: the listening class makes fewer tokens per token its leaving clients
#   read than the write-only one, in every run. Falsified by any run where it does not.
# * **not listening costs time** (a timing, not checked by CI): the write-only class takes longer for the same plan (until the
#   engine let go of the last stream). Falsified if the interval (at the coverage fixed before measuring, which each verdict prints) of the ratio of the classes'
#   times lies below one; "unclear" while it straddles it.

# %%
# NBVAL_IGNORE_OUTPUT
plan = run(leak.PLAN, target)

# %%
# NBVAL_IGNORE_OUTPUT
plan.scale()

# %%
# NBVAL_IGNORE_OUTPUT
plan.table("outcome")

# %%
# NBVAL_IGNORE_OUTPUT
plan.table("rows")

# %%
# NBVAL_IGNORE_OUTPUT
plan.verdict_table()

# %%
# NBVAL_CHECK_OUTPUT
print(plan.checked())

# %% [markdown]
# The checks are the part worth copying: they look at the cache, the registered streams and the
# number of releases, not only at whether the server still answers. Neither class can leak by
# design (both end every stream through the one close); what the write-only class costs is the
# work, tokens made for clients that had gone, and the time that work takes from everyone else.

# %%
# NBVAL_IGNORE_OUTPUT
target.close()
