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
# # 8. SSE in production: a proxy in front, a browser as the client, drain, what to watch
#
# Between the server and a person a stream meets a proxy that may buffer or compress, idle
# timeouts, a browser that reconnects on its own, restarts, and whoever watches the dashboards.
# This notebook puts each of them in front of the service and measures what happens: nginx
# (Debian's) as a child process, headless Chromium (Debian's) driven by Selenium, a real
# `labkit serve` process sent SIGTERM, and `/metrics` scraped during a load run.
#
# Where nginx or Chromium is missing, its section says what is missing and skips (`make
# system-deps` installs both where it can); every process this notebook starts, it stops.

# %% tags=["parameters"]
# Parameters: papermill replaces this cell's values (`papermill -p profile_name ci`).
# "full": SmolLM2-135M at the chapter's sizes; "ci": the tiny random GPT-2, a test run.
# LABKIT_PROFILE in the environment that started Jupyter overrides the default.
import os

profile_name = os.environ.get("LABKIT_PROFILE", "full")
model_name = ""  # "" runs the profile's model

# %%
# NBVAL_IGNORE_OUTPUT

from IPython.display import Image, Markdown, display

import labkit
from labkit.experiments import browser, drain, production, watch
from labkit.experiments.notebook import settings_table, setup_notebook
from labkit.experiments.progress import measuring
from labkit.experiments.proxy import nginx_binary
from labkit.experiments.readings import quiet_line, span, spread, verdict_lines, verdict_table
from labkit.experiments.results import save_run

profile = setup_notebook(profile_name, model_name, notebook="08_production")
production_config = production.Config.for_profile(profile)
browser_config = browser.Config.for_profile(profile)
drain_config = drain.Config.for_profile(profile)
watch_config = watch.Config.for_profile(profile)
for name, config in [("production", production_config), ("browser", browser_config), ("drain", drain_config),
                     ("watch", watch_config)]:
    print(name)
    display(settings_table(config))

# %% [markdown]
# ## Hypotheses, stated before measuring
#
# Each has the result that would falsify it; the verdicts are computed at the end.
#
# 1. **nginx holds events back when it buffers.** With `proxy_buffering on` and the service's
#    `X-Accel-Buffering: no` ignored, events reach the client late and in bursts; with buffering
#    off, or the header honoured, each passes at once. *Falsified if* the buffered condition's
#    median hold-back is under ten times the direct baseline's (and under 5 ms, the criterion's
#    floor, fixed before measuring), or an unbuffered one's is over it.
# 2. **gzip holds a buffered stream.** *Falsified if* gzip with buffering is not held, or gzip
#    without buffering is.
# 3. **Pings keep a quiet stream through the proxy.** A stream quiet for longer than
#    `proxy_read_timeout` survives with the service's `: ping` comments and is cut without them.
#    *Falsified if* any stream with pings is cut, or any without survives.
# 4. **The browser resumes exactly.** Cut mid-stream, Chromium's `EventSource` reconnects by itself
#    with `Last-Event-ID` and ends with exactly the events of an uninterrupted run. *Falsified if*
#    any cut run differs from the uninterrupted one in ids, types or data.
# 5. **`fetch` and `EventSource` agree** on the same stream. *Falsified if* any event differs.
# 6. **`retry:` sets the reconnect delay.** *Falsified if* a median delay is below its `retry:`,
#    or the two medians are closer than half the difference of the two values.
# 7. **Drain ends every open stream** with its `done` or an `error` event of type `shutdown`.
#    *Falsified if* any stream is cut without one.
# 8. **Drain refuses new work** with 503 (`draining`, `Retry-After`). *Falsified if* a request
#    answered during the drain gets anything else.
# 9. **The process exits within its drain timeout.** *Falsified if* it exits non-zero or later
#    than `drain_grace` + 2 s (a margin fixed before measuring).
# 10. **A resumable client is told why its stream ended** (the `error` event), and the restarted
#     server answers its resume with 404. *Falsified if* either is otherwise.
# 11. **A queue shows on `/metrics` while the batch is full**, and **the metrics account for every
#     stream** once the load is over. *Falsified if* no scrape sees a queue with a full batch, or
#     the first-token count differs from the requests sent, or anything stays open or held.

# %% [markdown]
# ## 1. A real proxy in front: the burst probe and keep-alive
#
# One stream at a time through nginx in each configuration, repetitions interleaved, with the
# server read directly as the baseline. For every token event we know when the server wrote it
# and when it reached the client. Then a quiet stream (queued behind others) through a short
# `proxy_read_timeout`, with pings on and off.

# %%
# NBVAL_IGNORE_OUTPUT
verdicts = {}
tables = {}
machines = {}
have_nginx = nginx_binary() is not None
if not have_nginx:
    print("skipped: nginx is missing (make system-deps installs it as root: apt-get install nginx)")
server_cm = labkit.serve_in_thread(**production.server_options(production_config))
server = server_cm.__enter__()  # one server for sections 1, 2 and 4; stopped at the end of section 4
print(f"serving {server.engine.model.name} at {server.url}")
if have_nginx:
    with measuring(production, production_config, profile) as progress:
        tables["production"] = production.run(production_config, server=server, progress=progress)
    machines["production"] = progress.machine
    verdicts["production"] = production.readings(tables["production"])
    figures = production.plot(tables["production"])
    save_run(production, production_config, profile, tables["production"], progress.elapsed_s, figures,
             machine=progress.machine)

# %% [markdown]
# Look for: grey ticks (written) and blue ticks (arrived) on top of each other where the proxy
# passes events on, and blue ticks bunched at the end where it holds them.

# %%
# NBVAL_IGNORE_OUTPUT
if have_nginx:
    display(tables["production"]["holdback"][["condition", "median_delay_ms", "max_delay_ms", "largest_burst",
                                              "share_in_bursts", "holds_back"]])
    display(spread(tables["production"]["events"].groupby(["condition", "repetition"], as_index=False).delay.median()
                   .assign(delay_ms=lambda d: 1000 * d.delay), "condition", "delay_ms"))
    display(tables["production"]["keepalive_summary"])

# %% [markdown]
# ## 2. A browser as the client
#
# The service serves a small page at `/lab/demo` (lab routes only; no CDN). It POSTs a
# resumable request, then follows the stream with `EventSource` on the resumable GET route (a
# lab twin of `GET /v1/streams/{id}/events` that can send `retry:` and cut its connection after
# a given event); beside it, the plain POST route is read with `fetch`. Headless Chromium runs the
# page through Selenium; the page records every event's id and arrival time, and Selenium reads
# them back. The uninterrupted run is the reference; the cut runs use two `retry:` values.

# %%
# NBVAL_IGNORE_OUTPUT
why_not = browser.missing()
if why_not:
    print("skipped:", why_not)
else:
    shot = browser.screenshot_path(profile)
    with measuring(browser, browser_config, profile) as progress:
        tables["browser"] = browser.run(browser_config, server=server, progress=progress, screenshot=shot)
    machines["browser"] = progress.machine
    verdicts["browser"] = browser.verdicts(tables["browser"], browser_config)
    figures = browser.plot(tables["browser"])
    save_run(browser, browser_config, profile, tables["browser"], progress.elapsed_s, figures,
             machine=progress.machine)
    print(browser.chromium_version())

# %%
# NBVAL_IGNORE_OUTPUT
if not why_not:
    runs = tables["browser"]["runs"]
    display(runs)
    cut = runs[runs.condition != browser.UNINTERRUPTED]
    display(spread(cut, "retry_ms", ["reconnect_delay_ms", "stream_ms"]))
    display(Markdown(
        f"The server cut the connection after event {browser_config.drop_after}; the browser came back with "
        f"the next event id in {int((cut.first_id_after_reconnect == browser_config.drop_after + 1).sum())} of "
        f"{len(cut)} cut runs, and {int(cut.same_as_uninterrupted.sum())} of them ended with exactly the "
        "uninterrupted events. Reconnect delay: "
        + "; ".join(f"`retry: {int(r)}` → {span(g.reconnect_delay_ms, '{:.0f}', ' ms')}"
                    for r, g in cut.groupby("retry_ms"))
        + f" ({browser_config.repetitions} repetitions each)."
    ))
    display(Image(filename=str(browser.screenshot_path(profile))))

# %% [markdown]
# ## 3. Drain on restart
#
# `labkit serve` runs as a subprocess. Streams are opened (every other one resumable) and one
# client never reads, so its writer blocks: that keeps the drain open long enough to be seen.
# The server decodes two sequences at a time, so at the signal some streams are running and some
# are waiting. From SIGTERM a prober sends a request every few tens of milliseconds until the port
# refuses. Then the same command starts a new server, and each resumable client tries to resume.

# %%
# NBVAL_IGNORE_OUTPUT
with measuring(drain, drain_config, profile) as progress:
    tables["drain"] = drain.run(drain_config, progress=progress)
machines["drain"] = progress.machine
verdicts["drain"] = drain.verdicts(tables["drain"], drain_config)
figures = drain.plot(tables["drain"])
save_run(drain, drain_config, profile, tables["drain"], progress.elapsed_s, figures, machine=progress.machine)

# %%
# NBVAL_IGNORE_OUTPUT
display(tables["drain"]["streams"])
display(tables["drain"]["process"])
display(tables["drain"]["reconnect"])
p = tables["drain"]["probes"]
answered = p[p.status.notna()]
display(Markdown(
    f"During the drain {len(answered)} new requests were answered, "
    f"{int((answered.status == 503).sum())} of them with 503 `draining`, the first "
    f"{answered.t.min():.2f} s and the last {answered.t.max():.2f} s after the signal; then the port refused. "
    f"The process exited {tables['drain']['process'].exited_after_s.iloc[0]:.2f} s after SIGTERM "
    f"(`drain_grace` {drain_config.drain_grace:g} s)."
) if len(answered) else Markdown("No request was answered during the drain."))

# %% [markdown]
# What a reconnect to the restarted server gets: the resumable stream's log lived in the old
# process's memory, so the new process has never heard of the id, and answers with the same 404
# an unknown id gets (a resume token proves nothing to a process that never issued it). A
# client that read the `error` event of type `shutdown` already knows its stream is over and
# must send its request again; one that was cut with no terminal event could not tell.

# %% [markdown]
# ## 4. What to watch
#
# A load run in waves, more streams at once than the batch holds, with `/metrics` scraped every
# half second and parsed with prometheus-client's parser. Look for: the queue rising with each
# wave and draining while the batch stays full; KV blocks in use following the running requests;
# first-token times growing with the queue while inter-token gaps stay put.

# %%
# NBVAL_IGNORE_OUTPUT
with measuring(watch, watch_config, profile) as progress:
    tables["watch"] = watch.run(watch_config, server=server, progress=progress)
machines["watch"] = progress.machine
verdicts["watch"] = watch.verdicts(tables["watch"], watch_config)
figures = watch.plot(tables["watch"])
save_run(watch, watch_config, profile, tables["watch"], progress.elapsed_s, figures, machine=progress.machine)
server_cm.__exit__(None, None, None)  # the shared server stops here

# %% [markdown]
# ## 5. A deadline gate
#
# Requests may carry a deadline; the gate predicts completion from the queue ahead and the
# measured step cost and refuses (429 with `Retry-After`, before the first byte) what cannot
# finish in time. Goodput against offered load, with and without the gate.

# %%
# NBVAL_IGNORE_OUTPUT
from labkit.experiments import deadline

deadline_config = deadline.Config.for_profile(profile)
display(settings_table(deadline_config))
with measuring(deadline, deadline_config, profile) as progress:
    tables["deadline"] = deadline.run(deadline_config, server=None, progress=progress)
machines["deadline"] = progress.machine
verdicts["deadline"] = list(deadline.verdicts(tables["deadline"]))
figures = deadline.plot(tables["deadline"])
save_run(deadline, deadline_config, profile, tables["deadline"], progress.elapsed_s, figures,
         machine=progress.machine)

# %% [markdown]
# ## Verdicts
#
# Every hypothesis with its criterion and the numbers that decided it.

# %%
# NBVAL_IGNORE_OUTPUT
all_verdicts = [v for vs in verdicts.values() for v in vs]
verdict_table(all_verdicts)

# %% [markdown]
# What must hold whatever the timings, checked by nbval under the small profile: the proxy's
# invariants per condition, and the verdicts that hold under both profiles (the tiny model and
# SmolLM2). The timings (the reconnect delay, the exit time, gzip) stay in the table above.

# %%
# NBVAL_CHECK_OUTPUT
if "production" in tables:
    print(production.report(tables["production"]))
    print(verdict_lines(v for v in verdicts["production"] if v.name != "gzip holds a buffered stream"))
if "browser" in tables:
    print(browser.report(tables["browser"], browser_config))
print(drain.report(tables["drain"], drain_config))
print(watch.report(tables["watch"], watch_config))
print(verdict_lines(verdicts["deadline"][:1]))  # the gate refuses only what would miss its deadline

# %%
# NBVAL_IGNORE_OUTPUT
for name, machine in machines.items():
    print(f"{name}: {quiet_line(machine)}")
