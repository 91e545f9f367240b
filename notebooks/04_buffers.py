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
# Between the engine and a reader sit buffers the application never sees: uvicorn's write
# buffer, the server's socket send buffer and the client's receive buffer. A client that connects,
# sends its request and then reads nothing shows how much they hold together. Two witnesses:
#
# 1. **The server's own** (labkit's lab routes): `POST /lab/flood` writes events of one size as
#    fast as the connection takes them and times every write; the first write that does not return
#    within the block threshold marks where the writer had to wait. The client, which never reads,
#    asks the kernel how many bytes wait in its own receive buffer (`FIONREAD`) at that moment,
#    then leaves. The kernel's limits (`net.ipv4.tcp_wmem`, `tcp_rmem`) are read from `/proc` in
#    the same run.
# 2. **The client's** (any server): a client cannot see a server's write block, only what waits
#    for it. An ordinary stream is left unread until its whole answer waits in the client's
#    receive buffer (see section 2), then read.
#
# Each measurement below is one cell: change a size in the call (`run(buffers.FLOOD, target,
# repetitions=5)`) and re-run that cell alone; the tables under it read the result it kept.

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
from labkit.experiments import buffers
from labkit.lab import run, setup, target_for

profile = setup("04_buffers", profile_name, model_name, device=device)
target = target_for(profile, target_url, device=device)
target

# %% [markdown]
# ## 1. A client that never reads
#
# Event sizes are settings, not measurements: the chapter's smallest (a token event in its
# format, larger than one of this service's), then larger ones (the scale table lists them),
# repeated in the order A B C D, A B C D, … One ordinary stream is also read before the floods,
# to size a real token event (`token_event_bytes`, kept in every row of the results), so bytes
# can be read as tokens.
#
# * **every flood blocks**: a client that reads nothing makes the server's write block once the
#   buffers are full. Falsified if any flood ends, or reaches its time limit, without a blocked
#   write.
# * **the server finishes after the leave**: after the client leaves by RST the server ends the
#   response. Falsified if any response is still unfinished at the time limit.
# * **bounded by the kernel**: what the path absorbs is at most the kernel's largest send buffer
#   (`tcp_wmem` max) plus the client's receive buffer, the server transport's high-water mark and
#   one event. Falsified if any flood accepted more. (Unclear where the server's kernel is not
#   this machine's, or there is no `/proc`.)
# * **the send buffer grows**: the server's side holds more than the kernel's default send buffer
#   (`tcp_wmem` default): Linux grows it while data waits. Falsified if any flood's bytes on the
#   server's side (accepted minus what sat in the client) are at most that default.
# * **bytes, not events**: the buffers hold bytes, so the amount absorbed hardly depends on the
#   event size. Falsified if the interval (at the coverage the verdict prints) of the ratio of the largest median to the smallest
#   (by event size) lies wholly above 1.5; unclear if it straddles 1.5.

# %%
# NBVAL_IGNORE_OUTPUT
flood = run(buffers.FLOOD, target)

# %%
# NBVAL_IGNORE_OUTPUT
flood.scale()

# %% [markdown]
# Per event size, median and min–max over the repetitions: bytes accepted before a write blocked,
# what sat in the client's receive buffer then (`FIONREAD`, the response head included), the rest
# on the server's side, and the same amount counted in events of this size and in ordinary token
# events (`token_events_held`).

# %%
# NBVAL_IGNORE_OUTPUT
flood.table("by_size")

# %% [markdown]
# The kernel's limits on those buffers (minimum, default, maximum, in bytes), read in this run:

# %%
# NBVAL_IGNORE_OUTPUT
flood.table("kernel")

# %%
# NBVAL_IGNORE_OUTPUT
flood.verdict_table()

# %% [markdown]
# The verdicts that must come out the same under every profile (the kernel is the same; checked
# by CI):

# %%
# NBVAL_CHECK_OUTPUT
print(flood.checked())

# %%
# NBVAL_IGNORE_OUTPUT
flood.plot();

# %% [markdown]
# ### Beside the chapter
#
# The chapter's figures came from its own machine, under Windows. On Linux the answer is a
# property of the kernel's settings, not of the application: read it against the kernel table
# and the reference lines of the figure.

# %%
# NBVAL_IGNORE_OUTPUT
flood.table("beside_chapter")

# %% [markdown]
# Read `token_events_held` for what this means to a reader: the path holds that many ordinary
# token events before a writer waits, far more than any one answer has, while the largest events
# fill it in far fewer (`events_accepted`). A slow reader of ordinary tokens is felt by the
# server only after a long while; padded or very large events (notebook 05) make it felt within
# as few events as `events_accepted` shows for the largest size.

# %% [markdown]
# ## 2. An ordinary stream, left unread, then read
#
# What a client can see of the same buffers against any server. A few ordinary streams are sent
# at once and none is read. The client only looks: it asks the kernel how many bytes wait in each
# receive buffer (`FIONREAD`) and peeks at them (`MSG_PEEK`, which leaves them to be read) until
# they hold a whole answer, through the end that HTTP's framing marks (the last chunk). Then it
# reads the stream as usual. Nothing here is timed against the engine: the hold ends on what
# arrived, so a slower or faster engine only holds longer or shorter. A server that ends its
# answer only by closing the connection gives no end to peek at, and says so as "not
# measurable".
#
# * **an unread stream waits whole in the buffers**: a stream of ordinary tokens fits between
#   the server and a reader that has stopped, so its writer never waits. Falsified if any held
#   stream's end has not reached the client's buffer within half the request's bound (the
#   scale table's `timeout_s`), or a held stream, read afterwards, is cut or fails.

# %%
# NBVAL_IGNORE_OUTPUT
unread = run(buffers.UNREAD, target)
unread.scale()

# %%
# NBVAL_IGNORE_OUTPUT
unread.table()

# %%
# NBVAL_IGNORE_OUTPUT
unread.verdict_table()

# %%
# NBVAL_CHECK_OUTPUT
print(unread.checked())

# %% [markdown]
# `waiting_bytes` is what the client's own receive buffer held, the head and the chunks' framing
# included; `bytes` is the stream's events. Where the first exceeds the second by the head and
# the framing (`end_waiting`), the whole answer sat in the client's buffer before it read a byte:
# the server had finished and freed the sequence, whatever the reader did next. This is why a stop in reading is invisible to a server until the buffers of
# the first section fill, and why notebook 06 detects a reader that has gone by its connection,
# not by its writes.

# %%
# NBVAL_IGNORE_OUTPUT
target.close()
