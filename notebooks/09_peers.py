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
# # 9. labkit beside a peer: the same experiments against `transformers serve`
#
# The lab's client-side experiments speak the OpenAI streaming API, so they can measure any
# server that does. Here `labkit serve` and `transformers serve --continuous-batching` run one
# after another as child processes of this interpreter on 127.0.0.1, with the same weights read
# from one saved Hugging Face folder, float32, on the CPU, each with a KV cache of the same size.
# Against each we run the overlap sweep (streams sent at once, rounds interleaved), the disconnect
# probe (streams leave by FIN or RST; the server's CPU time, read from `/proc/PID/stat`, says
# whether it went back to idle) and the slow-reader probe (healthy streams beside slow readers,
# against the same run's rounds without them). Every request is built from what a probe of the
# server found, not from its name; the table of what each server does differently comes first.
#
# ## Hypotheses, stated before measuring
#
# - **throughput_vs_peer**: labkit's aggregate tokens/s at the largest level is at least
#   transformers serve's. Falsified if labkit's median over the rounds is below the peer's.
# - **overlap_<server>**: each server batches, so its aggregate tokens/s at the largest level is
#   at least twice that of one stream. Falsified by less than twice.
# - **stops_after_leave_<server>**: each server stops generating when its clients leave, by FIN
#   and by RST. Falsified if the median release (1: back to idle CPU, 0: carried on) is below 0.5.
#
# Where a third server runs (llama.cpp's `llama-server`, vLLM), set `extra_url` below to its URL
# (for example `http://127.0.0.1:8080`, a `llama-server -m MODEL.gguf --port 8080` started by
# hand): it is measured as it is and added as a third column. Its CPU time is not read, so its
# disconnect row rests on a follow-up request's pace (see `labkit run disconnect --target`).

# %% tags=["parameters"]
# Parameters: papermill replaces this cell's values (`papermill -p profile_name ci`).
# "full": SmolLM2-135M at the chapter's sizes; "ci": the tiny random Llama, a test run.
# LABKIT_PROFILE in the environment that started Jupyter overrides the default.
import os

profile_name = os.environ.get("LABKIT_PROFILE", "full")
# transformers serve batches Llama models, so the ci run serves the tiny random Llama (same weights
# for both servers: labkit's seeded model, saved once as a Hugging Face folder), not tiny GPT-2.
model_name = "" if profile_name == "full" else "tiny-llama"
extra_url = ""  # a third OpenAI-compatible server to measure beside them, e.g. "http://127.0.0.1:8080"

# %%
# NBVAL_IGNORE_OUTPUT
from IPython.display import Markdown, display

from labkit.experiments import peers
from labkit.experiments.notebook import settings_table, setup_notebook
from labkit.experiments.progress import measuring
from labkit.experiments.readings import quiet_line, span, verdict_lines, verdict_table
from labkit.experiments.results import save_run

profile = setup_notebook(profile_name, model_name, notebook="09_peers")
config = peers.Config.for_profile(profile, extra_url=extra_url)
settings_table(config)

# %% [markdown]
# Each server is started, measured and stopped before the next starts, so they never share the
# two cores. If `transformers serve` cannot start here, the cell says why and the notebook goes on
# with the servers that did.

# %%
# NBVAL_IGNORE_OUTPUT
per_server, skipped = {}, {}
log_dir = profile.out_root / "build" / "peers" if profile.full else profile.out_root / "peers"
with measuring(peers, config, profile) as progress:
    for name in (peers.LABKIT, peers.TRANSFORMERS):
        why = peers.peer_missing() if name == peers.TRANSFORMERS else None
        if why:
            skipped[name] = why
            continue
        try:
            with peers.serve(name, config, log_dir) as server:
                print(f"{name}: up in {server.startup_s:.1f} s at {server.url} ({server.command})")
                per_server[name] = peers.run(config, server=server, progress=progress)
        except peers.TargetError as exc:
            skipped[name] = str(exc)
    if config.extra_url:
        try:
            per_server[peers.EXTRA] = peers.run(config, server=peers.Server(peers.EXTRA, config.extra_url), progress=progress)
        except peers.TargetError as exc:
            skipped[peers.EXTRA] = str(exc)
tables = peers.combine(per_server)
elapsed = progress.elapsed_s
for name, why in skipped.items():
    print(f"{name}: not measured: {why}")

# %% [markdown]
# ## What must hold whatever the timings
#
# Every stream of every round answered, at the requested length (each server's way of generating
# past end-of-sequence, found by the probe), and the slow readers were slow.

# %%
# NBVAL_CHECK_OUTPUT
print(peers.report(tables))

# %% [markdown]
# ## What each server does differently
#
# The probe's answers, one column per server: `[DONE]`, usage in streams, `stream_options`, how to
# run past end-of-sequence. Look for the rows where the columns differ.

# %%
# NBVAL_IGNORE_OUTPUT
tables["quirks"].pivot(index="question", columns="server", values="answer")

# %% [markdown]
# ## Side by side
#
# Each cell is the median over the rounds with the range (min–max) in brackets. Tokens/s is the
# aggregate over the streams of a round (tokens counted from usage where the server sends it);
# first token is the median, and the p99, over the streams of a round at the largest level;
# release after a disconnect is computed from the server's CPU time; the slow-reader row divides
# the healthy streams' makespan with slow readers by the median of the same run's rounds without.

# %%
# NBVAL_IGNORE_OUTPUT
closing = peers.closing_table(tables)
closing

# %%
# NBVAL_IGNORE_OUTPUT
figures = peers.plot(tables)

# %% [markdown]
# ## Per level and per round

# %%
# NBVAL_IGNORE_OUTPUT
tables["overlap_levels"].set_index(["server", "streams"])

# %%
# NBVAL_IGNORE_OUTPUT
tables["disconnect_verdicts"].set_index(["server", "leave_by"])

# %%
# NBVAL_IGNORE_OUTPUT
tables["slow_effects"].set_index(["server", "slow_readers"])

# %% [markdown]
# ## What only labkit can show
#
# Measurements that need a server's internals (its step log, block counts, its policies) are
# made for labkit in notebooks 03, 05 and 06, through labkit's own `/stats` and lab routes; the
# peers offer only the OpenAI API, so from the client's side of HTTP they are not available.

# %%
# NBVAL_IGNORE_OUTPUT
peers.unavailable_table(tables)

# %% [markdown]
# ## Verdicts
#
# Computed from the tables above against the criteria stated at the top. The checked cell below
# holds only the verdicts that come out the same under the small `ci` run and the full one.

# %%
# NBVAL_IGNORE_OUTPUT
found = peers.verdicts(tables)
verdict_table(found)

# %%
# NBVAL_CHECK_OUTPUT
print(verdict_lines(v for v in found if v.name.startswith("stops_after_leave")))

# %%
# NBVAL_IGNORE_OUTPUT
runs = tables["overlap_runs"]
top = int(runs.level.max())
lines = [
    f"- {s}: {span(runs[(runs.server == s) & (runs.level == top)].tokens_per_s, '{:.1f}')} tokens/s at {top} streams, "
    f"{span(runs[(runs.server == s) & (runs.level == 1)].tokens_per_s, '{:.1f}')} at 1, over "
    f"{int((runs.server == s).sum() / runs.level.nunique())} rounds."
    for s in dict.fromkeys(runs.server)
]
display(Markdown("\n".join(["What was measured here:", *lines])))
written = save_run(peers, config, profile, tables, elapsed, figures, machine=progress.machine)
print("figures:", ", ".join(p.name for p in written["figures"]), "| results:", written["results"])
print(quiet_line(progress.machine))

# %% [markdown]
# How to read it: the two servers run the same matrix products, so a gap in tokens/s comes from
# what surrounds them: how requests are admitted and prefilled, how a step is assembled, what a
# token costs on its way to the socket. Compare the first-token rows with the throughput rows: a
# server that prefills many arrivals in one batch trades the early streams' first token for the
# later ones'. A release near 1 after FIN and after RST means the server stopped generating for
# clients that left; a slow-reader ratio near 1 means the slow readers cost the healthy streams
# nothing that a client can see, whatever the server did with their backlog.
