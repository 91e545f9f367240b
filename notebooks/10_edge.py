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
# # 10. At the edge: browsers, proxies, tokens and restarts
#
# Notebook 08 put nginx in front of the server and watched events cross it. Between a stream and a
# real reader there is more: a browser that opens few connections per origin and has rules of its
# own for reconnecting, a token that expires while a reader is away, a deploy that restarts the
# server under every open stream, a sync generator that quietly holds a thread, a compressor in the
# app, a proxy that may or may not pass on a closed tab. Each measurement below starts the real
# components it needs on 127.0.0.1 (a headless Chromium driven by Selenium, nginx with a
# self-signed certificate made by `openssl`, Debian's `redis-server`, `labkit serve` processes)
# and stops them when it ends; a machine without one gets a "not measurable" row naming it.
#
# Each measurement is one cell: change a size in the call (`run(edge.STORM, target, clients=300)`)
# and re-run that cell alone; the tables and figures under it read the result it kept.

# %% tags=["parameters"]
# Parameters (papermill replaces these: `papermill -p profile_name ci`). "full": SmolLM2-135M;
# "ci": the tiny random GPT-2, a test run. LABKIT_PROFILE in the environment that started Jupyter
# sets the default. target_url "": labkit in a background thread; a URL: another labkit server
# (started with --lab-routes; what it cannot witness says so).
import os

profile_name = os.environ.get("LABKIT_PROFILE", "full")
model_name = ""
target_url = ""
device = "cpu"

# %%
# NBVAL_IGNORE_OUTPUT
from labkit.experiments import edge
from labkit.lab import run, setup, target_for

profile = setup("10_edge", profile_name, model_name, device=device)
target = target_for(profile, target_url, device=device)
target

# %% [markdown]
# ## 1. Six connections per origin
#
# A page opens ten `EventSource`s to one origin, each a slow stream of a few ticks (the lab's
# `/lab/slow/async`, no model involved), and once those that could open have opened it fetches a
# small JSON route of the same origin. Over HTTP/1.1 (labkit itself) a browser keeps at most six
# connections per origin, and an open stream holds one; over HTTP/2 (nginx with TLS in front) the
# streams share one connection. The page records when each stream's first event and the fetch's
# answer arrived, and which protocol carried them.
#
# * **six per origin over HTTP/1.1**: exactly six streams get their first event before the first
#   stream ends; the seventh and later, and the fetch, wait for a stream to end. Falsified by any
#   other count in any repetition, or a fetch answered before a stream ended.
# * **HTTP/2 multiplexes**: through nginx every stream and the fetch start before the first stream
#   ends, over `h2`. Falsified by any one that waits.

# %%
# NBVAL_IGNORE_OUTPUT
six = run(edge.SIX, target)

# %% [markdown]
# Time to each stream's first event, by the order the streams were made (median, min and max over
# the repetitions):

# %%
# NBVAL_IGNORE_OUTPUT
six.table("first_event")

# %%
# NBVAL_IGNORE_OUTPUT
six.verdict_table()

# %%
# NBVAL_CHECK_OUTPUT
print(six.checked())

# %%
# NBVAL_IGNORE_OUTPUT
six.plot();

# %% [markdown]
# The step in the HTTP/1.1 line is the queue: streams seven to ten start only when the first six
# end, and so would every request of the page to that origin, including the app's own API calls.
# HTTP/2 at the edge lifts it (the HTTP/2 line); one stream shared across tabs, not measured here,
# would avoid it too.

# %% [markdown]
# ## 2. EventSource's own rules
#
# One `EventSource` per case, through nginx (whose access log counts every request the browser
# made): a finished stream replayed through the lab's demo route, which cuts the connection once
# after a few events (a network error) and answers `Last-Event-ID` like the resume route, with no
# `retry:` field and with one; a route whose upstream is down (nginx answers 502); and a route that
# answers 200 with JSON. The page logs every open, event and error with its `readyState`, and
# watches a while after the `EventSource` closed. Beside it, labkit's own resume route is asked
# for a finished stream's last id with the lab's raw client.
#
# * **it reconnects and resumes**: after the cut and after the normal end it reconnects by itself
#   with `Last-Event-ID`; every event arrives once, in order. Falsified by a session with other
#   than two opens, or an event lost or repeated.
# * **a 204 stops it for good**: the reconnect after the end gets 204 and no request follows.
#   Falsified by a request after the 204 within the watch window.
# * **Chromium's default delay**: without `retry:` the reconnect waits about three seconds.
#   Falsified by a median delay outside three to three and a half seconds (unchecked: a time).
# * **retry: sets the delay**: with `retry:` the delay is its value. Falsified by a median outside
#   that value plus half a second (unchecked).
# * **a 502 or a wrong type closes it**: a 502 from the proxy, or a 200 with JSON, gets one
#   request, `readyState` CLOSED, and no retry. Falsified by a second request.
# * **the resume route's 204 comes first**: a finished stream asked for its last id answers a bare
#   204, with no body and no stream media type (decided before the response starts). Falsified by
#   anything else.

# %%
# NBVAL_IGNORE_OUTPUT
rules = run(edge.RULES, target)

# %%
# NBVAL_IGNORE_OUTPUT
rules.table("cases")

# %%
# NBVAL_IGNORE_OUTPUT
rules.verdict_table()

# %%
# NBVAL_CHECK_OUTPUT
print(rules.checked())

# %% [markdown]
# A cut and a normal end look alike to `EventSource`: both are followed by the same fixed delay
# and a reconnect, so a server that answered that reconnect with 200 and an event stream would be
# asked again after every delay (no case here answers so). Of the answers tried, a 204, a 502 and
# a 200 with JSON each stopped it, and it does not tell a deliberate stop (204) from a proxy's
# accident (502): after a 502 the page must make a new `EventSource` itself.

# %% [markdown]
# ## 3. POST, fetch and a bearer token that expires
#
# `EventSource` can send neither a body nor an `Authorization` header, so a chat page reads its
# stream with `fetch`. Here the server checks bearer tokens (`auth_secret`, a lab setting; tokens
# from `POST /lab/token`, with the short lifetime `ttl_s` of the scale table). The page POSTs a
# resumable stream with its token, reads a few events, loses the connection (it aborts the fetch),
# waits until its token has expired, and resumes with `?after=` and its last id, with the stale
# token or with a fresh one fetched first.
#
# * **without a refresh, a 401 ends it silently**: the resume gets 401 with a Bearer challenge
#   (`invalid_token`), and a reader that stops on a non-200 ends short with no error of its own.
#   Falsified by any resume answered otherwise, or a stream that completed.
# * **with a refresh, nothing lost**: the stream completes with every event once, in order, ending
#   with `done`. Falsified by any event lost or repeated, or no `done`.

# %%
# NBVAL_IGNORE_OUTPUT
auth = run(edge.AUTH, target)
auth.scale()

# %%
# NBVAL_IGNORE_OUTPUT
auth.table("rows")

# %%
# NBVAL_IGNORE_OUTPUT
auth.verdict_table()

# %%
# NBVAL_CHECK_OUTPUT
print(auth.checked())

# %% [markdown]
# The server checks the token once, when a request starts (`labkit/service/auth.py`). This reader
# was away when its token expired, so the expiry surfaced only when it came back. A reader that treats every non-200 as
# the end loses the rest of the answer without a word: refresh before reconnecting.

# %% [markdown]
# ## 4. A reconnect storm
#
# N clients hold resumable streams on a `labkit serve` process that keeps its logs in Redis. The
# process is told to stop: it drains, ending every stream with its `shutdown` error, and a new
# process starts on the same port with the same store and a connection cap below N (a replica
# that takes a share of the clients, not all of them). Each client then resumes with its last id,
# after a fixed delay, or with exponential backoff and full jitter (a delay drawn uniformly below
# a ceiling that doubles at each attempt); a refusal's `Retry-After` is waited out first. Every
# attempt is timed. The model is irrelevant here: both profiles serve the tiny one (the scale
# table says so).
#
# * **every client whole**: every client ends with every event once, in order, the drain's
#   `shutdown` error last, and an answer only Redis lets the new server give: 204 (nothing left),
#   or the events it missed (a client cut before the error; the `replayed` column of the table counts them).
#   Falsified by any client short of it.
# * **jitter flattens the herd**: once the new server answers (its first answer to any client,
#   `up_s`), the jittered clients' peak
#   of reconnects per hundred milliseconds is at most half the fixed delay's. Falsified in any
#   repetition above that. (While the old server drains it still answers resumes, from its log.)
# * **jitter meets fewer refusals**: the connection cap refuses (503 with `Retry-After`) fewer
#   jittered reconnects. Falsified by as many or more in any repetition; unclear where the fixed
#   delay met no refusal, as then there was nothing to have fewer of. Each client has a connection
#   of its own, kept alive after its answer as a browser keeps it, so an answered client holds its
#   slot for the server's `idle_timeout`: how many the cap refuses is meant to follow from the cap,
#   the timeout and the clients' schedule rather than from how fast the server answers (neither the
#   speed nor the timeout is varied here; unchecked all the same: it is a count of a race).

# %%
# NBVAL_IGNORE_OUTPUT
storm = run(edge.STORM, target)
storm.scale()

# %%
# NBVAL_IGNORE_OUTPUT
storm.table("storm")

# %%
# NBVAL_IGNORE_OUTPUT
storm.verdict_table()

# %%
# NBVAL_CHECK_OUTPUT
print(storm.checked())

# %%
# NBVAL_IGNORE_OUTPUT
storm.plot();

# %% [markdown]
# With a fixed delay the clients stay in step: while the server is down they reconnect in waves
# (`no_server` counts those attempts), and `refused_503` says how many the new server's cap
# turned away. Jitter spreads them at the price the table shows in `last_served_s`: when the last
# client is served.

# %% [markdown]
# ## 5. A resume log that survives a restart
#
# A client reads a few events of a resumable stream and goes away; the server process restarts
# (a drain, then the same command again); the client resumes with its last id. With the memory
# store the log died with the process; with Redis (a `redis-server` the experiment starts) the new
# process replays what the client missed, to the end the run had: `done`, or the drain's
# `shutdown` error if the restart caught it mid-run (the table says which). Then what the
# Redis log costs: synthetic token events appended through the store as a resumable run appends
# them, one awaited round trip each (`store_cost`), and their bytes in Redis beside each event's
# encoded SSE size.
#
# * **Redis: resumed with nothing lost**: the resume gets every event after the client's last id
#   once, in order, to the run's end. Falsified by any event lost or repeated, or no end.
# * **memory: forgotten**: the restarted process answers 404. Falsified by anything else.

# %%
# NBVAL_IGNORE_OUTPUT
restart = run(edge.RESTART, target)
restart.scale()

# %%
# NBVAL_IGNORE_OUTPUT
restart.table("rows")

# %% [markdown]
# The log's cost per event, one row per repetition: microseconds per append (median, p90, max of
# the events appended), and bytes per event in Redis beside the event's encoded SSE size:

# %%
# NBVAL_IGNORE_OUTPUT
restart.table("cost")

# %%
# NBVAL_IGNORE_OUTPUT
restart.verdict_table()

# %%
# NBVAL_CHECK_OUTPUT
print(restart.checked())

# %% [markdown]
# ## 6. Sync generators exhaust the thread pool
#
# A route whose body is a plain `def` generator runs each `next()` in AnyIO's thread pool, whose
# default limiter has 40 tokens; a generator blocked between events holds one. Here up to 40 slow
# streams (`/lab/slow/sync`, blocked in `time.sleep` between events, or `/lab/slow/async`, its
# `async` twin) are open while a sync health route and the async one are timed, and the limiter's
# books (`/lab/threads`) are read while the sync one waits. The engine takes no part.
#
# * **forty sync streams queue a sync route**: with 40 sync streams every token is borrowed and the
#   sync health route is seen waiting in most repetitions; with fewer it never waits. Falsified
#   otherwise (counts from the limiter's books).
# * **otherwise nothing waits**: with fewer sync streams, or with async ones, the sync health
#   route never waits, and async streams borrow no token. Falsified by any wait or any borrowed.
# * **the sync route pays**: at 40 sync streams the sync health route takes more than five times
#   the async one. Falsified if the interval (at the coverage the verdict prints) of the ratio lies below five (unchecked).

# %%
# NBVAL_IGNORE_OUTPUT
threads = run(edge.THREADS, target)
threads.table("latency")

# %%
# NBVAL_IGNORE_OUTPUT
threads.verdict_table()

# %%
# NBVAL_CHECK_OUTPUT
print(threads.checked())

# %%
# NBVAL_IGNORE_OUTPUT
threads.plot();

# %% [markdown]
# A health check written as a plain `def` route is the sync route that queues: its answer waits
# behind the held threads (`sync_health_ms` at 40 sync streams) while the event loop still answers
# the async `/healthz`. A load balancer whose probe timeout were shorter than that wait would take
# a working server out of service (no probe was run here).

# %% [markdown]
# ## 7. Compression in the app
#
# Starlette's `GZipMiddleware` in front of the app (`gzip`: `off`; `default`, its own list of
# excluded types, `text/event-stream` among them; `events`, streams compressed too). The client
# asks for gzip and reads a stream of events written a known interval apart, decompressing as the
# bytes arrive and noting when each whole event is in; a plain answer (`/metrics`) shows what
# `default` does compress.
#
# * **default leaves streams alone**: a stream goes out uncompressed, a plain answer compressed.
#   Falsified by either being otherwise.
# * **gzip per event holds nothing back**: in every setting every event arrives as it is written,
#   none within a quarter interval of the one before, and `events` does compress. Falsified by a
#   bunched or a missing event.

# %%
# NBVAL_IGNORE_OUTPUT
gzip = run(edge.GZIP, target)
gzip.table("gzip")

# %%
# NBVAL_IGNORE_OUTPUT
gzip.verdict_table()

# %%
# NBVAL_CHECK_OUTPUT
print(gzip.checked())

# %% [markdown]
# The middleware flushes after every message, so compression in the app changes an event's size on
# the wire (`wire_bytes_per_event`, `events` beside `off`) and holds none back (`bunched`).
# Where notebook 08 saw events held back, its verdicts name the proxy's setting that did it; this
# cell runs no proxy.

# %% [markdown]
# ## 8. A tab closed behind nginx
#
# A page on nginx's origin streams with `fetch` and its tab is closed, with nginx's
# `proxy_ignore_client_abort` off (its default) and on, at two moments: mid-stream, once the
# server has generated a few tokens (its own records say so), and while the request waits in the
# queue (the server's one batch slot held by another stream until labkit hears of the close, or a
# few seconds have passed), when nothing is being written. Does labkit stop generating? Its stream
# records say how many tokens it made and when it closed the stream and released its blocks,
# counted from the moment the tab began to close. The stream is long enough that what follows the
# close is far more than the 16 KB (a constant of Chromium's network stack, not a measurement) that
# Chromium may still read from a cancelled response to reuse its connection.
#
# * **streaming: stopped, off or on**: mid-stream the generation stops early either way: with the
#   setting off nginx passes the close on at once, with it on at its next write to the closed tab. Falsified by a run that made every token.
# * **queued, off: never admitted**: with the setting off nginx passes the close on at once, and
#   the request is cancelled before its first token. Falsified by any token made.
# * **queued, on: admitted for no one**: with it on nginx says nothing until it has something to
#   write, so the request is admitted and makes tokens after the tab is gone (a few, until that
#   first write fails). Falsified by none, or by all of them.

# %%
# NBVAL_IGNORE_OUTPUT
close = run(edge.CLOSE, target)
close.table("close")

# %%
# NBVAL_IGNORE_OUTPUT
close.verdict_table()

# %%
# NBVAL_CHECK_OUTPUT
print(close.checked())

# %% [markdown]
# With `proxy_ignore_client_abort` on, nginx passes a close on only when it next writes: a stream
# that writes every token still stops within a few tokens either way (`closed_after_ms` and the
# tokens made, off beside on), but a request that waits in the queue is admitted and makes tokens
# for no one. (A long prefill, not run here, writes nothing either.)

# %%
# NBVAL_IGNORE_OUTPUT
target.close()
