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
# # 8. SSE in production: a proxy in front, a browser as the client, a drain, what to watch
#
# Between the server and a person a stream meets a proxy that may buffer or compress, idle
# timeouts, a browser that reconnects on its own, restarts, and whoever watches the dashboards.
# Each of them is put in front of the service here and measured: nginx (Debian's) as a child
# process with a generated config on 127.0.0.1, headless Chromium (Debian's) driven by Selenium,
# a `labkit serve` process sent SIGTERM, and `/metrics` scraped during a load; then the chapter's
# fifth exercise, a deadline gate in front of the batched engine.
#
# Where nginx or Chromium is missing, its measurement says so in one line and measures nothing
# (`make system-deps` installs both where it can); every process started here is stopped here.
# Each measurement is one cell: change a size in the call (`run(production.PROXY, target,
# tokens=128)`) and re-run that cell alone; the cells under it read the result it kept.

# %% tags=["parameters"]
# Parameters (papermill replaces these: `papermill -p profile_name ci`). "full": SmolLM2-135M at
# the notebook's sizes; "ci": the tiny random GPT-2, a test run. LABKIT_PROFILE in the environment
# that started Jupyter sets the default. target_url "": labkit in a background thread; a URL:
# any OpenAI-compatible server (the measurements it cannot witness say so).
import os

profile_name = os.environ.get("LABKIT_PROFILE", "full")
model_name = ""
target_url = ""
device = "cpu"

# %%
# NBVAL_IGNORE_OUTPUT
from labkit.experiments import production
from labkit.lab import run, setup, target_for

profile = setup("08_production", profile_name, model_name, device=device)
target = target_for(profile, target_url, device=device)
target

# %% [markdown]
# ## 1. A real proxy in front
#
# nginx is started with one location per setting: `proxy_buffering` on or off, the service's
# `X-Accel-Buffering: no` honoured or ignored (`proxy_ignore_headers`), gzip on or off for
# `text/event-stream`, and one location that speaks HTTP/1.1 (chunked) to the upstream instead of
# nginx's default HTTP/1.0. The same request goes through every location at once, and once
# straight to the target, as a reference. A token's *lag* through one setting is how many more
# tokens had arrived through the fastest setting by then, less the setting's start offset (a few
# steps if its request was admitted later, read from the tokens that arrive while the fastest
# setting still streams): a hold-back counted in tokens, not in seconds, and measured against the
# other settings, so a stall of nginx or of this client lags every setting alike, and a median
# counts it only where it covers half the stream.
#
# Hypotheses, with what would falsify each, fixed before measuring:
#
# * **every stream whole through nginx**: every proxied stream ends with its own end, as long as
#   the direct one. Falsified by any failed, cut or shorter stream.
# * **nginx holds events back only where it buffers**: with `proxy_buffering on`, the header
#   ignored and an unchunked upstream (with or without gzip), events lag by at least the
#   `held_lag` of the scale table (the median over the stream); every other setting passes each
#   event on at once, below it. Falsified by any run of any setting on the wrong side.

# %%
# NBVAL_IGNORE_OUTPUT
proxy = run(production.PROXY, target)

# %%
# NBVAL_IGNORE_OUTPUT
proxy.scale()

# %% [markdown]
# Per setting, over the repetitions: the median and the largest lag in tokens, the largest burst
# (tokens that arrived in one read), how many runs held events back, and the response's
# `Content-Encoding` as the client saw it.

# %%
# NBVAL_IGNORE_OUTPUT
proxy.table("routes")

# %%
# NBVAL_IGNORE_OUTPUT
proxy.verdict_table()

# %%
# NBVAL_CHECK_OUTPUT
print(proxy.checked())

# %%
# NBVAL_IGNORE_OUTPUT
proxy.plot();

# %% [markdown]
# Where the grey ticks (the stream read directly) and the blue ticks (through nginx) coincide,
# the proxy passes each event on; where the blue ticks bunch at a few moments, it holds them until
# a buffer fills or the stream ends. A held stream is whole, but a user sees it in lumps or all at
# the end. Where the verdict holds, the service's `X-Accel-Buffering: no` is what keeps a
# buffering nginx from holding the stream, so a proxy that ignores the header undoes it; gzip
# matters only where the proxy already buffers; and a chunked upstream is passed on chunk by chunk
# even with buffering on.

# %% [markdown]
# ## 2. Keep-alive through `proxy_read_timeout`
#
# nginx cuts an upstream that sends nothing for `proxy_read_timeout`. A stream queued behind
# others is quiet between its `start` event and its first token: here the server has one batch
# slot, and enough longer requests go first (sent directly, not through nginx) to keep the probe
# quiet for a few read timeouts; how many is measured in the same run, from one of them timed
# alone. The probe goes through nginx to a server whose `keepalive_interval` sends `: ping`
# comments well within the timeout, or to one whose interval is longer than any probe waits.
#
# * **pings keep a quiet stream through the proxy**: every probe with pings ends with its own end
#   after a silence longer than the read timeout, and every probe without them is cut. Falsified
#   by any probe on the wrong side, or a probe with pings that was not quiet long enough to test it.

# %%
# NBVAL_IGNORE_OUTPUT
keepalive = run(production.KEEPALIVE, target)

# %%
# NBVAL_IGNORE_OUTPUT
keepalive.scale()

# %%
# NBVAL_IGNORE_OUTPUT
keepalive.table("rows")

# %%
# NBVAL_IGNORE_OUTPUT
keepalive.verdict_table()

# %%
# NBVAL_CHECK_OUTPUT
print(keepalive.checked())

# %% [markdown]
# A comment line is not an event: the client's parser drops it, and no token is spent on it, but
# it is bytes on the wire, which is all a proxy's read timeout looks at. Without it, a stream that
# waits in a queue behind others is cut by the proxy before its first token, and the client sees
# a response that ended without its `done`.

# %% [markdown]
# ## 3. A browser as the client
#
# The service serves a small page at `/lab/demo` (lab routes only; nothing loaded from elsewhere).
# It POSTs a resumable request, lets that connection go, and follows the stream with the
# browser's `EventSource` on a lab twin of the resumable GET route that can send `retry:` and cut
# its connection after a given event. Headless Chromium runs the page through Selenium; the page
# records every event and every connection change, and Selenium reads them back. The
# uninterrupted run is the reference, repeated beside runs cut after the same event with two
# `retry:` values (the scale table).
#
# * **the browser resumes exactly**: every cut run reconnects once by itself, the new connection
#   starts with the event after the cut (`Last-Event-ID`), and the run ends with exactly the ids,
#   types and data of the uninterrupted one. Falsified by any cut run that does not.
# * **retry: sets the reconnect delay** (a timing, not checked by CI): the browser never reconnects
#   sooner than the server's `retry:`, and every delay of the longer value exceeds every delay of
#   the shorter. Falsified otherwise.

# %%
# NBVAL_IGNORE_OUTPUT
browser = run(production.BROWSER, target)

# %%
# NBVAL_IGNORE_OUTPUT
browser.scale()

# %%
# NBVAL_IGNORE_OUTPUT
browser.table("rows")

# %%
# NBVAL_IGNORE_OUTPUT
browser.table("delays")

# %%
# NBVAL_IGNORE_OUTPUT
browser.verdict_table()

# %%
# NBVAL_CHECK_OUTPUT
print(browser.checked())

# %% [markdown]
# The browser does the resuming: the page's code never reconnects, it only listens. What makes the
# resume exact is on the server's side, an id on every event and a log to replay from the id the
# browser sends back. The delay before it comes back is the server's to set with `retry:`.

# %% [markdown]
# ## 4. Drain on SIGTERM, and a restart
#
# `labkit serve` runs as a process of its own (started here beside the in-thread server, with the
# scale table's settings and two batch slots): one held by a client that never reads, so its
# writer blocks and the drain stays open long enough to be seen. Only once the server reports that
# stream paused (its writes blocked: before that it would take its `shutdown` event at once and the
# drain would be over before the first probe) are the other streams opened, every other one
# resumable, and some wait for a slot. Once every stream is open and one is decoding, SIGTERM;
# from that moment a prober sends a short request after each answer until the port refuses. Then
# the same command starts the server again on the same port, and each resumable stream's client
# tries to resume.
#
# * **drain ends every open stream**: each ends with its `done` or an `error` event of type
#   `shutdown`. Falsified by any stream cut without one.
# * **drain refuses new work**: every request answered during the drain gets 503 with
#   `Retry-After` and type `draining` (or `shutdown`, for one admitted just as the drain began and
#   then ended by it), and at least one gets `draining`. Falsified by any other answer.
# * **exits within its drain grace** (a timing, not checked by CI): exit status 0, no later than
#   `drain_grace` after the signal plus two seconds for the interpreter's own exit.
# * **a restarted process answers the resume with 404**: each resumable stream was told why it
#   ended, and its resume gets the 404 an unknown id gets. Falsified otherwise.

# %%
# NBVAL_IGNORE_OUTPUT
drain = run(production.DRAIN, target)

# %%
# NBVAL_IGNORE_OUTPUT
drain.scale()

# %% [markdown]
# Every answer the prober got, counted by status and type over every drain (the scale table's repetitions):

# %%
# NBVAL_IGNORE_OUTPUT
drain.table("answers")

# %%
# NBVAL_IGNORE_OUTPUT
drain.table("streams")

# %%
# NBVAL_IGNORE_OUTPUT
drain.verdict_table()

# %%
# NBVAL_CHECK_OUTPUT
print(drain.checked())

# %% [markdown]
# A resumable stream's log lives in the memory of the process that issued it, so the restarted
# process answers its resume as it answers any unknown id. A client that read the `error` event
# of type `shutdown` already knows its stream is over and must send its request again; one that
# was cut without a terminal event could not tell a restart from a network failure.

# %% [markdown]
# ## 5. What to watch
#
# A load in waves, more streams at once than the batch holds, with `/metrics` scraped on a timer
# and parsed with prometheus-client's parser. Each wave is also scraped at a moment counted in
# tokens, once a batch's worth of its streams are decoding, and the next wave is sent once every
# stream of this one has begun.
#
# * **a queue shows while the batch is full**: every such scrape sees requests queued with the
#   batch at its fullest. Falsified by any that does not.
# * **the metrics account for every stream**: after the load, the first-token histogram's count
#   has grown by the number of requests, and nothing is open, queued or holding KV blocks.
#   Falsified by any other count.

# %%
# NBVAL_IGNORE_OUTPUT
metrics = run(production.WATCH, target)

# %%
# NBVAL_IGNORE_OUTPUT
metrics.verdict_table()

# %%
# NBVAL_CHECK_OUTPUT
print(metrics.checked())

# %%
# NBVAL_IGNORE_OUTPUT
metrics.plot();

# %% [markdown]
# The queue rises with each wave and drains while the batch stays full, and the KV blocks in use
# follow the running requests. A dashboard shows the same gauges; what a scrape on a timer cannot
# promise is to land on any given moment, which is why the checked scrapes are taken at moments
# counted in tokens.

# %% [markdown]
# ## 6. A deadline gate
#
# A request may carry `deadline_s`; the gate predicts its finish from the queue ahead and the
# engine's recent step times, and refuses (429 with `Retry-After`, before the first byte) what it
# predicts cannot finish in time. Two servers on the same model differ only in the gate; the
# scale is measured first on the one without it: a request's latency alone, and the service rate
# (requests finished per second with the batch kept full).
#
# First, probes whose answer does not depend on the machine:
#
# * **the gate refuses only what would miss**: a request behind a batch of far longer ones, with
#   a deadline of one solo latency, is refused by the gate and misses its deadline without it; a
#   request on an idle server with ample time is admitted and meets it. Falsified otherwise.

# %%
# NBVAL_IGNORE_OUTPUT
gate = run(production.GATE, target)
gate.verdict_table()

# %%
# NBVAL_CHECK_OUTPUT
print(gate.checked())

# %% [markdown]
# Then goodput, above the service rate, where a gate can matter. Each repetition offers a fixed
# number of requests as Poisson arrivals at one of the loads of the scale table (taken in turn),
# each request with a deadline of a few solo latencies; its client leaves at the deadline. Both
# servers get the same arrival times in a repetition, one after the other. Before its run, the
# server with the gate serves one request alone, long enough to fill the window of steps the gate
# predicts from: otherwise it would predict from the previous run's last steps, and a gate that
# refuses everything runs no step to learn from. Offered load and goodput (requests that met their
# deadline per second of arrivals) are both in units of the service rate, so they read the same on
# any engine; the offered load on the figure is the one each run actually offered.
#
# * **the gate raises goodput above the service rate** (a timing, not checked by CI): the ratio
#   of requests that met their deadline with the gate over without it, pair by pair (each count
#   plus a half, so that a side that met none stays finite), has a confidence interval above 1. Falsified
#   if the interval lies below 1; unclear if it straddles 1 (the verdict then says how many
#   repetitions would decide it, or that no practical number would, when the ratio lies too near 1).

# %%
# NBVAL_IGNORE_OUTPUT
goodput = run(production.GOODPUT, target)

# %%
# NBVAL_IGNORE_OUTPUT
goodput.scale()

# %% [markdown]
# Every run (one row each: what it offered, what met its deadline, missed it or was refused), then
# each repetition's pair on the same arrivals, with the ratio the verdict reads. `ratio` is the
# requests that met their deadline with the gate over those without, ½ added to each side so that
# a pair where one side met none stays finite (the two runs of a pair send the same arrivals, so
# their windows differ only by the client's pacing).

# %%
# NBVAL_IGNORE_OUTPUT
goodput.table("rows")

# %%
# NBVAL_IGNORE_OUTPUT
goodput.table("pairs")

# %%
# NBVAL_IGNORE_OUTPUT
goodput.verdict_table()

# %%
# NBVAL_IGNORE_OUTPUT
goodput.plot();

# %% [markdown]
# Each point is one run at the load it actually offered, and a grey line joins the two runs of one
# repetition, so the spread between runs is in view beside the difference the gate makes. Without
# the gate, a request that waits in the queue past its deadline is left by its client, after it
# may already have taken steps; with it, a request predicted to miss is refused before it costs a
# step, and a wrong prediction refuses one that would have made it. Which of the two weighs more
# here is what the verdict's interval says, and how sure.

# %%
# NBVAL_IGNORE_OUTPUT
target.close()
