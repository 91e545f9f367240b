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
# Several streams of the same length share the engine and k of their readers are slow; the rest
# read as fast as they can. Each hub policy is a different answer to who pays for the slow ones:
#
# * `naive`: the engine's step loop hands each event over and waits until it is taken;
# * `unbounded`: a queue per stream, without limit;
# * `pause`: a stream `high_water` events behind leaves the decode batch, keeping its slot and
#   its blocks, until its reader has caught up half-way;
# * `drop`: a stream `high_water` events behind for the stall timeout is cancelled, and its reader
#   gets an `error` event of type `slow_client` after what was already sent;
# * `pause_then_drop`: pause first, drop a stream still paused at the stall timeout.
#
# Every policy has its own server on the same loaded model, and every token event carries an SSE
# comment of `pad_bytes` (the scale table gives every size): ordinary token events fit the buffers
# between server and client (notebook 04), so without the padding no policy would ever see a
# slow reader. For the same reason the server's send buffer is capped: Linux would otherwise grow
# it to hold a whole stream.
#
# How slow is slow is measured, not assumed. The runs go policy by policy, k = 0 first, and a
# slow reader aims at `slow_fraction` of the rate its policy's k = 0 run just before was written
# at: one read asking for the bytes that rate allows, then a pause (the socket may hand over
# fewer). It reads until its stream's own end
# or its `error` event and never leaves early, so a dropped reader sees the error (a bound on the
# whole request stops it if something hangs). What it read per read and the rate it achieved are
# in the tables. The stall timeout is counted in steps of a warm-up's step interval, so a policy
# drops at the same point of a stream on a faster or slower engine.

# %% tags=["parameters"]
# Parameters (papermill replaces these: `papermill -p profile_name ci`). "full": SmolLM2-135M at
# the chapter's sizes; "ci": the tiny random GPT-2, a test run. LABKIT_PROFILE in the environment
# that started Jupyter sets the default. target_url "": labkit in a background thread; a URL: any
# OpenAI-compatible server (measured under its own policy, without padding, as a client sees it).
import os

profile_name = os.environ.get("LABKIT_PROFILE", "full")
model_name = ""
target_url = ""
device = "cpu"

# %%
# NBVAL_IGNORE_OUTPUT
from labkit.experiments import slowclient
from labkit.lab import run, setup, target_for

profile = setup("05_slow_clients", profile_name, model_name, device=device)
target = target_for(profile, target_url, device=device)
target

# %% [markdown]
# ## Slow readers under each policy
#
# Hypotheses, with what would falsify each, fixed before measuring:
#
# * **healthy streams whole**: under every policy every healthy stream ends with its own end,
#   with all its tokens. Falsified by any that fails or comes short.
# * **naive delays the healthy**: under `naive` the step loop waits for the slow readers, so the
#   healthy streams finish much later than in the same repetition's run with nobody slow.
#   Falsified if the interval (at the coverage fixed before measuring, which each verdict prints) of that ratio (pooled over k) lies below one and a half;
#   "unclear" while it straddles it.
# * **queues isolate the healthy**: under the other policies the healthy streams finish no later
#   than a quarter past their time with nobody slow. Holds if for each of them the interval lies
#   below one and a quarter (below one too would mean they finish sooner beside slow readers,
#   who read less and so cost the shared cores less); falsified if for any it lies above.
# * **same steps** (where the target has a step log): a slow reader costs the healthy streams
#   seconds, never engine steps: a healthy stream takes as many steps from its first token to its
#   release as with nobody slow. Falsified by a difference of more than two steps.
# * **policies act**: in every run `naive` holds at most two of a slow stream's events (the one in
#   hand and the next), `unbounded` queues them past the mark, `pause` pauses it, `drop` and
#   `pause_then_drop` cancel it. Falsified by any run in which its policy did not.
# * **the dropped reader is told**: a dropped reader that reads on gets the `slow_client` error
#   event after its backlog. Falsified by any dropped reader that ends without it.
# * **slow is slow**: a slow reader reads at most half of what its server writes. Falsified by
#   any that read faster.

# %%
# NBVAL_IGNORE_OUTPUT
policies = run(slowclient.POLICIES, target)

# %% [markdown]
# The sizes beside the chapter's (a row says why where they differ):

# %%
# NBVAL_IGNORE_OUTPUT
policies.scale()

# %% [markdown]
# What paced the slow readers, run by run: the write rate of the policy's k = 0 run just before
# (bytes per second, per stream) and the read it allowed (empty in the k = 0 runs, which pace no one).

# %%
# NBVAL_IGNORE_OUTPUT
policies.table("rows")[["policy", "slow", "repetition", "writer_Bps", "asked_read_bytes"]]

# %% [markdown]
# Who pays: per policy and number of slow readers, the healthy streams' completion in seconds
# (from the launch to the last healthy stream's end), `done_vs_k0` (over the same repetition's
# run with nobody slow), the steps a healthy stream took from its first token to its release, and
# the gaps between its tokens; median, min and max over the repetitions.

# %%
# NBVAL_IGNORE_OUTPUT
policies.table("compare")

# %% [markdown]
# The slow readers: the bytes one read actually took and the rate achieved (`ratio`: over the
# write rate that paced it); when the `error` event reached a dropped reader and when its request
# left the engine (seconds from the launch); how long the request held its slot and blocks
# (`slot_held_s`), how long and for how many engine steps it was paused, its longest pause, and
# the most events its queue held. From the server's records where the target has them.

# %%
# NBVAL_IGNORE_OUTPUT
policies.table("slow_readers")

# %%
# NBVAL_IGNORE_OUTPUT
policies.verdict_table()

# %% [markdown]
# The verdicts that must come out the same under every profile and engine speed (checked by CI):

# %%
# NBVAL_CHECK_OUTPUT
print(policies.checked())

# %%
# NBVAL_IGNORE_OUTPUT
policies.plot();

# %% [markdown]
# Read each policy's rows against its own k = 0 rows, never against another policy's. Under
# `naive` the healthy streams take as many steps as ever, but the steps are further apart: the
# step loop waits for the slow readers between them, and the healthy streams' gap p99 shows it
# (a median and range over the repetitions, shown, not judged). The other policies differ in who carries the slow readers' backlog:
# `unbounded` keeps it in the queue (its largest queue) and lets the request go as soon as it is
# generated; `pause` keeps the request, its slot and its blocks, for as long as the reader needs
# to catch up (the time and steps paused, and `slot_held_s`); `drop` and `pause_then_drop` give
# the slot back and tell the reader, but only after it has read what was already sent: compare
# when its request left the engine with when the `error` event reached it. Where the "queues
# isolate" evidence puts a policy's interval below one, its healthy streams finished sooner
# beside slow readers than with nobody slow: a reader that reads less costs the shared cores
# less.

# %%
# NBVAL_IGNORE_OUTPUT
target.close()
