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
# # 3. Overlapping streams: what batching buys, and what a single stream pays
#
# One server answers 1, 2, 4, … streams sent at the same moment, each on its own connection, and
# we measure from the client's side: the makespan (first request sent to last stream ended), the
# aggregate tokens per second, the time to first token and the gap between tokens; from the
# server's step log (`GET /lab/steps`, where the target has one) how many engine steps each level
# took. Every stream makes exactly the same number of tokens (end-of-sequence is ignored), every
# condition is repeated in the order A B C, A B C, and the baseline is measured in the same sweep:
# serving N streams one after another takes N times the median makespan of the sweep's own
# level-1 runs.
#
# Each measurement below is one cell: change a size in the call (`run(overlap.LEVELS, target,
# levels=(1, 64))`) and re-run that cell alone; the tables and figures under it read the result it
# kept and measure nothing again.

# %% tags=["parameters"]
# Parameters (papermill replaces these: `papermill -p profile_name ci`). "full": SmolLM2-135M at
# the chapter's sizes; "ci": the tiny random GPT-2, a test run. LABKIT_PROFILE in the environment
# that started Jupyter sets the default. target_url "": labkit in a background thread; a URL:
# any OpenAI-compatible server (the measurements it cannot witness say so).
import os

profile_name = os.environ.get("LABKIT_PROFILE", "full")
model_name = ""
target_url = ""
device = "cpu"

# %%
# NBVAL_IGNORE_OUTPUT
from labkit.experiments import overlap
from labkit.lab import run, setup, target_for

profile = setup("03_overlap", profile_name, model_name, device=device)
target = target_for(profile, target_url, device=device)
target

# %% [markdown]
# ## 1. Levels
#
# Hypotheses, with what would falsify each, fixed before measuring:
#
# * **every stream whole**: every stream of every level ends with its own end, at the same length
#   in every repetition. Falsified by any failed stream or a level whose token count varies.
# * **overlap in steps**: the engine advances the streams of the largest level together: a step
#   makes at least half as many tokens as there are streams. Falsified below that (a step log is
#   needed; it counts steps, so it does not depend on the engine's speed).
# * **overlap**: the largest level reaches at least twice the aggregate tokens/s of one stream.
#   Falsified if the interval (at the coverage fixed before measuring, which each verdict prints) of the paired ratio (same repetition) lies below 2; "unclear"
#   when the interval straddles it.
# * **per-stream gap**: a stream's median gap grows much less than the number of streams.
#   Falsified if the median gap ratio is at least a quarter of the number of streams.

# %%
# NBVAL_IGNORE_OUTPUT
levels = run(overlap.LEVELS, target)

# %% [markdown]
# The sizes beside the chapter's (a row says why where they differ):

# %%
# NBVAL_IGNORE_OUTPUT
levels.scale()

# %% [markdown]
# Median and min–max over the repetitions of each level. `speedup` is the back-to-back baseline
# over the makespan, so level 1's own speedups show the noise the others are read against;
# `steps` and `tokens_per_step` come from the engine's step log.

# %%
# NBVAL_IGNORE_OUTPUT
levels.table("levels")

# %%
# NBVAL_IGNORE_OUTPUT
levels.verdict_table()

# %% [markdown]
# The verdicts that must come out the same under every profile and engine speed (checked by CI):

# %%
# NBVAL_CHECK_OUTPUT
print(levels.checked())

# %%
# NBVAL_IGNORE_OUTPUT
levels.plot();

# %% [markdown]
# Read the speedup against level 1's own spread, and the step counts against the token counts:
# at the largest level nearly every step advances every stream, which is where the aggregate
# comes from. The price is paid by each stream, in its gap between tokens and, for requests that
# arrive together, in the first token.

# %% [markdown]
# ## 2. Why the aggregate grows: the cost of a decode step, in both modes
#
# A step decodes every running sequence in one pass, reading the weights once for all of them, so
# its cost grows far more slowly than the number of sequences (and not necessarily in a straight
# line: the library picks its kernels by shape). Both modes are timed in the same run, every (batch,
# mode) point in rounds interleaved with the others, on engines kept alive in this process: the
# batch-invariant mode (the default: every element of every product summed in one fixed order,
# so a row's result does not depend on its neighbours) and the plain one (the library's
# products). The table after the costs gives, per mode, the measured step at the smallest batch
# (what every step pays) and the marginal cost of one more sequence between the smallest and the
# largest batch, with the rounds' range: measured quantities, not a fitted line.
#
# * **invariant costs no more**: the invariant step costs at most a bar fixed before measuring
#   times the plain one at every batch (the verdict table states the bar). Each round gives a
#   ratio per batch, both modes timed in it; falsified if at any batch the interval of the ratios
#   (at the coverage fixed before measuring, which the verdict prints) lies above the bar, unclear
#   if at any batch it straddles the bar.
# * **a step for many is cheap**: a step of the largest batch costs less than half as many times
#   a step of one as it has sequences (invariant mode). Judged the same way, by the interval of
#   the round-by-round ratio. Both are timings, so neither is checked by CI: the table is the
#   evidence.

# %%
# NBVAL_IGNORE_OUTPUT
step_cost = run(overlap.STEP_COST, target)

# %%
# NBVAL_IGNORE_OUTPUT
step_cost.table("step_cost")

# %%
# NBVAL_IGNORE_OUTPUT
step_cost.table("marginal")

# %%
# NBVAL_IGNORE_OUTPUT
step_cost.verdict_table()

# %%
# NBVAL_IGNORE_OUTPUT
step_cost.plot();

# %% [markdown]
# ## 3. Late joiners
#
# Short requests into an idle engine (each sent a moment after the previous one ended, so none
# overlaps another) and into running batches. A joiner into a batch is sent when the first long
# stream has made a number of tokens drawn at random, so the moment falls at the same point of
# the run however fast the engine is. From the server's records each joiner's wait is counted in
# steps begun meanwhile and in durations of the steps it waited through: in an idle engine the
# wait is its own prefill; in a running batch the step in progress comes first.
#
# * **every joiner answered**: every joiner gets its first token. Falsified by any failure.
# * **a joiner waits about a step**: at each running batch (each background), the median joiner
#   has its first token sampled within two step durations of its arrival. Falsified above two at
#   any of them. Unlike a count of steps begun, this is in the unit of the batch it joins, so a
#   joiner that waited for a long prefill of others would show it.

# %%
# NBVAL_IGNORE_OUTPUT
joiners = run(overlap.JOINERS, target)

# %%
# NBVAL_IGNORE_OUTPUT
joiners.table("joiners")

# %%
# NBVAL_IGNORE_OUTPUT
joiners.verdict_table()

# %%
# NBVAL_CHECK_OUTPUT
print(joiners.checked())

# %%
# NBVAL_IGNORE_OUTPUT
joiners.plot();

# %% [markdown]
# ## 4. First-token delivery: at the end of its own prefill, or at the end of the step
#
# Many requests arriving together are admitted and prefilled. The chapter's server prefilled
# them one by one, so a first token handed over as its own prefill ended came sooner than one
# held until the step's end, and the chapter's exercise asks which part of the distribution
# improves. This engine prefills a step's prompts in one pass (`BatchEngine.step`: one
# `forward` over every chunk), so the first tokens of one step exist at the same moment, and
# handing each over as it is sampled can gain only the rest of the step's bookkeeping. The hub
# does both (`first_token="prefill"` or `"step_end"`); the two servers take turns, repetition
# after repetition, and the table answers the exercise per quantile: step-end over prefill,
# paired by repetition, with its interval (at the coverage fixed before measuring, which each
# verdict prints). The prediction, from the engine's design, is that no part improves by more
# than a step's bookkeeping, which is small beside a step:
#
# * **one pass, one moment: the median**: the interval of step-end over prefill at the median
#   lies within 0.8–1.25 (a band fixed before measuring; per-prompt prefills would put the median
#   near 2). Falsified if it lies wholly outside the band, unclear if it crosses an edge.
# * **one pass, one moment: the last**: the same at the maximum (the last first token).

# %%
# NBVAL_IGNORE_OUTPUT
delivery = run(overlap.DELIVERY, target)

# %%
# NBVAL_IGNORE_OUTPUT
delivery.table("by_quantile")

# %%
# NBVAL_IGNORE_OUTPUT
delivery.verdict_table()

# %%
# NBVAL_CHECK_OUTPUT
print(delivery.checked())

# %%
# NBVAL_IGNORE_OUTPUT
delivery.plot();

# %% [markdown]
# The exercise's answer is the table's, quantile by quantile: where a quantile's interval lies
# wholly above 1, prefill delivery handed that quantile's first token over sooner, by the ratio
# shown; where the interval holds 1, this run shows no difference there. The verdicts ask the
# chapter's question at a coarser grain: a ratio inside the band is what one pass for a step's
# prompts predicts, and per-prompt prefills would have put it far outside.

# %% [markdown]
# ## 5. What the client in this process costs the numbers above
#
# Every measurement above that has a server (all but the step cost's, which times the engine
# directly) runs it in a thread of this notebook's own interpreter, beside
# the client that reads it, and the two share the interpreter's lock and the cores. They share one
# more thing: the parallel loops' threads. This notebook's main thread loaded the model and ran
# loops of its own, so the server's step thread is a second OpenMP team in the process, and with
# more teams' threads than cores every loop waits for a sleeping worker to wake; a server in a
# process of its own gives its main thread's team up and leaves the step thread the only one
# (`labkit/engine/threads.py`). The same top level is served here from a thread and from a process
# of its own, interleaved: the ratio says how far the absolute tokens/s above understate what the
# same server does in a process of its own, still read by this notebook's client on the same
# cores (notebook 09 runs every server in its own process); the table's first-token columns show
# the first token under each. Ratios within this notebook compare like with like.

# %%
# NBVAL_IGNORE_OUTPUT
share = run(overlap.CLIENT_SHARE, target)
share.table("servers")

# %%
# NBVAL_IGNORE_OUTPUT
share.verdict_table()

# %% [markdown]
# ## 6. An independent client: GuideLLM beside the lab's
#
# Every number in this notebook was read by the lab's own client, so an error in it would be in
# all of them. GuideLLM (vLLM's benchmark tool, a separate program: `make guidellm`) reads the same
# server here in three conditions, in turn with the lab's client: each client alone with all the
# streams at once (GuideLLM through its `concurrent` profile), and both clients at once, half the
# streams each. Always the same length past end-of-sequence, the same OpenAI completions route, a
# `labkit serve` process of its own so that neither client shares an interpreter with the server.
# Both quantities are defined alike on both sides (tokens/s over first request to last token; a
# request's inter-token latency as its span over its gaps, the median over requests).
#
# * **both clients whole**: every request of both ends at its length. Falsified by any failure.
# * **tokens/s agree** and **inter-token latency agrees**: GuideLLM's median over the lab's lies
#   within 0.8 to 1.25. Falsified outside it. Where they part, the table says in which client's
#   turns the server ran slower; the next two criteria say whether that was a misreading.
# * **each client reads the server's own pace**: the two clients share the machine with the
#   server, so a client that spends more of the cores on itself slows the server it reads, and
#   then the two clients disagree while each reads truly. The server's step log is the witness
#   that tells the cases apart: in every run, the client's inter-token latency over the server's
#   median decode period in that run (from the start of one decode step to the start of the
#   next) lies within 0.8 to 1.25. Falsified by any run outside it: a client that misreads the
#   streams it gets.
# * **read at once, the two agree**: with both clients reading the server together, half the
#   streams each (the lab's client opens its half once the server holds all of GuideLLM's), the
#   streams share the server's steps, so whatever a client costs the server, the other client pays
#   too. In every such run, GuideLLM's tokens/s and inter-token latency over the lab client's lie
#   within 0.8 to 1.25. Falsified by any run outside it: then the two clients read the same steps
#   differently. (Runs too short for the halves to overlap, as in the `ci` profile's, can falsify
#   it for that reason alone; the table's server period shows whether they shared the steps.)

# %%
# NBVAL_IGNORE_OUTPUT
guidellm = run(overlap.GUIDELLM, target)
guidellm.table("tools")

# %% [markdown]
# The same quantities from the runs with both clients at once, per client:

# %%
# NBVAL_IGNORE_OUTPUT
guidellm.table("at_once")

# %%
# NBVAL_IGNORE_OUTPUT
guidellm.verdict_table()

# %% [markdown]
# How to read the four together: if the turns part while the runs at once agree and each client
# keeps the server's own pace, both clients read truly and differ only in what they cost the server
# they read (the server period column says how much); if the runs at once part too, one of the two
# misreads the streams, and the table at once says which.

# %%
# NBVAL_CHECK_OUTPUT
print(guidellm.checked())

# %%
# NBVAL_IGNORE_OUTPUT
target.close()
