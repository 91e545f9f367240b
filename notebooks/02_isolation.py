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
# A decode step runs every sequence of the batch through the same matrix products. Nothing in
# the arithmetic lets one row read another, but the order in which a product sums its terms may
# follow the shape of the whole matrix, and floating-point sums in another order round
# differently. By default the engine is batch-invariant (`batch_invariant=True`: every element
# of every product is summed in one fixed order whatever the batch, `labkit/engine/matmul.py`),
# which is meant to make a row's numbers those it would have alone. The plain mode
# (`batch_invariant=False`, the library's products) is the counterfactual, measured in the same
# run on the same loaded model.
#
# Two measurements, two questions:
#
# 1. **Streams** (the chapter's comparison, over HTTP): is every concurrent stream's answer,
#    token id by token id, the answer it gets alone? This is what a client can see, but a
#    difference in the numbers shows in the tokens only where it crosses a near tie between the
#    two best tokens, so a clean result here says little about the numbers.
# 2. **Logits** (in this process, on the engine's runner): are a row's logits in a batch bitwise
#    its logits alone, at every step, in both modes, in float32 and bfloat16? This is what the
#    claim is about, and it sees every difference, however small; the greedy tokens that flipped
#    are counted beside it, with the solo margin and how far the batch moved it, or the note that
#    a third token overtook both (`overtaken`), which no top-2 margin explains.

# %% tags=["parameters"]
# Parameters (papermill replaces these: `papermill -p profile_name ci`). "full": SmolLM2-135M at
# the chapter's sizes; "ci": the tiny random GPT-2, a test run. LABKIT_PROFILE in the environment
# that started Jupyter sets the default. target_url "": labkit in a background thread; a URL:
# a server with labkit's native API (an OpenAI-only server has no token ids to compare).
import os

profile_name = os.environ.get("LABKIT_PROFILE", "full")
model_name = ""
target_url = ""
device = "cpu"

# %%
# NBVAL_IGNORE_OUTPUT
from labkit.experiments import isolation
from labkit.lab import run, setup, target_for

profile = setup("02_isolation", profile_name, model_name, device=device)
target = target_for(profile, target_url, device=device)
target

# %% [markdown]
# ## 1. Streams against their solo runs, over HTTP
#
# Each prompt is streamed alone, one after another; then the first N prompts are streamed at
# once, for every level, repeated, and every concurrent stream is compared token id by token id
# with its solo run. Both modes run on servers of their own (the plain one is a second server on
# the same loaded model), with their own solo runs. Where a stream differs, its row names the
# first differing token and the engine step that made it (from the server's record of the
# stream). Hypotheses, fixed before measuring:
#
# * **concurrent equals solo (invariant)**: with `batch_invariant` on, every concurrent stream has
#   its solo run's token ids. Falsified by any stream that differs or fails.
# * **alone equals solo**: a stream served alone repeats its solo run in either mode, so a
#   difference at higher levels comes from the neighbours, not from run-to-run noise. Falsified
#   by any level-1 stream that differs.
#
# The plain mode's count is shown, without a verdict: whether a greedy token flips depends on
# near ties that a run this size may not meet (section 2 measures how many it could expect).

# %%
# NBVAL_IGNORE_OUTPUT
streams = run(isolation.STREAMS, target)

# %%
# NBVAL_IGNORE_OUTPUT
streams.scale()

# %% [markdown]
# Per mode and level: streams compared, how many were identical to their solo run, and the
# earliest first differing token and engine step where any differed.

# %%
# NBVAL_IGNORE_OUTPUT
streams.table("levels")

# %% [markdown]
# Every stream that left its solo run, with the two tokens where it did (empty: none did):

# %%
# NBVAL_IGNORE_OUTPUT
streams.table("divergences")

# %%
# NBVAL_IGNORE_OUTPUT
streams.verdict_table()

# %%
# NBVAL_CHECK_OUTPUT
print(streams.checked())

# %% [markdown]
# ## 2. Logits against the solo run, bit for bit
#
# On the engine's runner (the public `ModelRunner` and `BlockManager`, no server), a few
# prompts, the *probes*, are prefilled and decoded alone; then the same probes are decoded inside
# batches of every size in the sizes table, beside other prompts as neighbours, each run on
# blocks of its own. Every probe is fed its solo run's tokens, so alone and batched see the same
# inputs at every step, and at every step its logits are compared with its solo logits: equal in
# every bit or not, the largest difference, the solo run's margin between its two best tokens,
# how far the batch moved that margin, and whether the greedy token flipped. Step 0 is the
# prefill (alone, or packed with the batch's other prompts). Both modes, float32 and bfloat16
# (the chapter's earlier flips came from half precision). Batch 1 is a probe run alone a second
# time; the batches around a power of two look for a dependence on padding or tiles.
#
# * **invariant (float32): bitwise identical**: with `batch_invariant` on, every probe's logits
#   at every batch size and step are bitwise its solo logits. Falsified by one bit. Checked: the
#   fixed-order kernel that makes it so is a float32 kernel.
# * **invariant (bfloat16): bitwise identical**: the same in bfloat16, where the invariant mode
#   rests instead on the library's products, checked for equal rounding when the runner starts;
#   a reading of this machine and model, not checked.
# * **alone repeats itself**: a probe run alone twice has the same logits in every mode and
#   precision. Falsified by one bit.
# * **plain: batched logits differ in bits** (one per precision): with `batch_invariant` off, some
#   probe's logits in some batch differ from its solo ones. Falsified if none does. Whether the
#   library's products change their order with the batch depends on the library and the
#   machine, so this verdict is a reading of this machine, not checked.

# %%
# NBVAL_IGNORE_OUTPUT
logits = run(isolation.LOGITS, target)

# %%
# NBVAL_IGNORE_OUTPUT
logits.scale()

# %% [markdown]
# Per precision, mode and batch size: probe-steps compared (`rows`), how many differ in any bit
# and their share, the largest difference, the first step with one, greedy flips, the smallest
# solo margin met, and the flip rate the differences imply: half the share of (margin, move) pairs
# in which the move exceeds the margin (a move goes against the leading token half the time), as
# if margins and moves were independent.

# %%
# NBVAL_IGNORE_OUTPUT
logits.table("rows")

# %% [markdown]
# Every token that flipped, with its solo margin and how far the batch moved it, or `overtaken`
# where a third token passed both of the solo run's top two (empty: none):

# %%
# NBVAL_IGNORE_OUTPUT
logits.table("flipped")

# %%
# NBVAL_IGNORE_OUTPUT
logits.verdict_table()

# %%
# NBVAL_CHECK_OUTPUT
print(logits.checked())

# %%
# NBVAL_IGNORE_OUTPUT
logits.plot();

# %% [markdown]
# ## What the token comparison could have shown
#
# The plain-mode tokens that section 1 compared in batches, and the flips the float32 flip rate
# above lets one expect among them, at most (where no move beat any margin, the rate is bounded by
# the number of margins seen, so a small run bounds it only loosely). Where that is below one, a
# clean token comparison in the plain mode was the likely outcome whether or not the numbers
# depend on the batch. Where it is above one only because the rate is that loose bound (flips per
# 1000 at zero), the clean comparison is no evidence either way. In both cases only the bitwise
# comparison can tell the two modes apart.

# %%
# NBVAL_IGNORE_OUTPUT
isolation.power(streams, logits)

# %% [markdown]
# Read the two sections together. The invariant mode's claim is about bits, and section 2 checks
# it bit for bit at every step, in both precisions; section 1 confirms it end to end, through the
# service and the wire. The plain mode differs in bits wherever the library changes its order of
# summation with the batch (`first_step` says where it starts; step 0 is the prefill), but a
# difference in bits becomes a different token only at a near tie. The margins and the implied
# flip rates say how near the ties come in float32 and in bfloat16, where a logit has a few
# significant bits and exact ties between the two best tokens occur (`min_margin`); `flips` counts
# the tokens that did flip in this run. Sampling with per-request seeds is notebook 07's.

# %%
# NBVAL_IGNORE_OUTPUT
target.close()
