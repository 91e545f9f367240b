"""Write notebooks 05-07 (slow clients, disconnects and leaks, extensions), without outputs.

    python notebooks/build_notebooks_failures.py        # all three
    python notebooks/build_notebooks_failures.py 06     # only those whose file name starts with 06

Same conventions as ``build_notebooks.py`` (whose helpers this imports): one setup cell, a server
started by the notebook, the experiment run through ``labkit.experiments``, tables and inline
figures, the chapter's GPU figures beside ours, the server stopped. Varying cells start with
``# NBVAL_IGNORE_OUTPUT``; the invariant checks print stable text under ``# NBVAL_CHECK_OUTPUT``.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from build_notebooks import HERE, check, ignore, md, save, serve_and_run, write_notebook  # noqa: E402


def setup(module: str):
    return ignore(f"""
        import time

        import labkit
        from labkit.experiments import {module}
        from labkit.experiments.common import save_run, setup_notebook

        profile = setup_notebook()
        config = {module}.Config.for_profile(profile)
        config
    """)


def notebooks() -> dict[str, list]:
    return {
        "05_slow_clients.ipynb": slow_cells(),
        "06_disconnect_and_leaks.ipynb": disconnect_cells(),
        "07_extensions.ipynb": extension_cells(),
    }


# --------------------------------------------------------------------------- 05 slow clients


def slow_cells() -> list:
    return [
        md("""
            # 5. A client that cannot keep up

            Eight streams of 64 tokens share the engine, and k of their readers (0, 1, 2 or 4) are slow:
            after every read of at most 64 KiB they sleep a quarter of a second. Each token event carries
            a 64 KiB SSE comment, a laboratory device that makes one stream about 4 MB, because ordinary
            token events of about 100 bytes never fill the buffers between server and client (notebook
            04). Every policy of the hub is run on its own server, all on one loaded model:

            * `naive`: the engine's step loop hands each event over and waits until it is taken;
            * `unbounded`: per-stream queues without limit;
            * `pause`: a stream 8 events behind leaves the decode batch, keeping its slot and blocks;
            * `drop`: a stream 8 events behind for 0.25 s is cancelled with an `error` of type `slow_client`;
            * `pause_then_drop`: pause first, cancel a stream that stays paused for 0.25 s.

            One difference from the chapter, stated plainly: Linux here lets a connection's send buffer
            grow to about 4 MB, enough for a whole padded stream, so no policy would ever see a slow
            reader. The main runs cap the server's `SO_SNDBUF` at 256 KiB (the service's `sndbuf`
            setting; the chapter's machine absorbed 0.25 to 0.33 MB); one extra run, marked `linux`,
            keeps the kernel's own sizing.

            A second difference: "slow" is relative to how fast the engine writes. The chapter's GPU
            wrote about 25 times faster than its reader read; two CPU cores write 64 KiB events at a
            few hundred KiB/s, about what the chapter's reader takes. So after the first run, in which
            nobody is slow, the slow reader's reads are made smaller if needed, so that it takes at most
            half of what the server wrote to each reader; the sleep stays at 0.25 s. The `pace` table
            says what was measured and used.
        """),
        setup("slowclient"),
        md("""
            The notebook's server is the first policy's; the experiment starts one more server per
            policy, and each is stopped before the next starts. This takes about five minutes on the
            `full` profile, most of it spent waiting for the slow readers.
        """),
        serve_and_run("slowclient"),
        md("## Every server afterwards"),
        check("print(slowclient.report(tables))"),
        ignore("tables['pace']"),
        md("""
            ## Who pays

            One row per policy and number of slow readers: when the last healthy stream ended, its worst
            p99 gap between tokens, when the slow streams' sequences left the engine (the engine's own
            timestamps), when the slow clients finished reading and how their streams ended.
        """),
        ignore("tables['grid']"),
        md("""
            ## A full batch

            With a batch limit of 4, two slow readers take slots first and six fast requests arrive
            behind them. The sampled engine state says how many slots paused streams held while others
            waited (in slot-seconds), and what that cost the fast requests.
        """),
        ignore("tables['saturation']"),
        md("""
            ## The memory an eager server would hold

            The lab's hub queues unformatted events and builds the padding as each one is written. A
            server that built each event's bytes up front would keep every queued event at its full size. Under
            `unbounded`, the peak number of events queued at once (sampled every 10 ms) times the
            measured size of one event gives that memory; `bound_bytes` is the arithmetic ceiling,
            every token of every slow stream, and `unread_at_release_bytes` what the slow clients had
            still to read when their sequences left the engine (queue and kernel together).
        """),
        ignore("tables['eager']"),
        save("slowclient"),
        md("## Beside the chapter"),
        ignore("slowclient.beside_chapter(tables)"),
        ignore("print(slowclient.findings(tables, config))"),
        md("""
            Reading the tables: only `naive` makes healthy streams wait for a slow one, because its step
            loop cannot move on until a reader takes an event; the other policies keep the healthy
            streams at their k = 0 pace and differ in who carries the slow reader's backlog. `unbounded`
            lets the sequence finish and leaves the backlog in memory; `pause` keeps the sequence, its
            slot and its blocks until the reader catches up, which is what the full-batch table charges
            to the fast requests; `drop` and `pause_then_drop` give the slot back quickly and the slow
            client learns it from an `error` event after reading what was already sent. The `linux` row
            is the caution: with the kernel's own buffer sizes the backlog sits in the kernel and even
            the naive server does not notice the slow reader.
        """),
    ]


# --------------------------------------------------------------------------- 06 disconnects and leaks


def disconnect_cells() -> list:
    return [
        md("""
            # 6. When the client goes away

            A streamed request lives on after the handler that began it returns, so something must notice
            that its client has gone and give back what the request holds. Two experiments.

            **Disconnect.** A client leaves by FIN (an orderly close) or by RST (an abortive one) at five
            moments: while its request waits for a slot (the batch limit is 4 and four other streams
            fill it), right after the response headers, after 2 tokens, half-way and 4 tokens before the
            end. Two servers differ only in their response class: Starlette's `StreamingResponse`, which
            listens for the disconnect and cancels the body, and a write-only class that never listens,
            as Starlette's own behaves on servers speaking ASGI 2.4. We measure the time from the
            client's close to the engine's release of the stream's blocks, on one clock, and the tokens
            generated that nobody read. Each stream asks for 48 tokens (the chapter's 200 would make
            every write-only trial four times longer on two CPU cores); trials run four at a time,
            two repetitions with FIN and RST, which is exactly the batch limit.
        """),
        setup("disconnect"),
        serve_and_run("disconnect"),
        md("## The books after each server"),
        check("print(disconnect.report(tables))"),
        md("""
            Per moment and way of leaving. `release_ms` runs from the client's close to the engine's
            finish event for the stream; `ever_admitted` counts streams that ever got a slot, which for
            the `waiting` moment should be none with Starlette's class.
        """),
        ignore("tables['by_moment']"),
        save("disconnect"),
        md("""
            **Leak.** Many streams from up to 48 concurrent clients, batch limit 8, on a seeded plan: 35%
            read to the end, half leave after 0 to 40 tokens by FIN or RST, 15% read slowly and leave
            after 3 or 10 tokens. Afterwards we inspect the server, not the responses.
        """),
        ignore("""
            from labkit.experiments import leak

            leak_config = leak.Config.for_profile(profile)
            started = time.perf_counter()
            with labkit.serve_in_thread(**leak.server_options(leak_config)) as server:
                leak_tables = leak.run(leak_config, server=server)
            leak_elapsed = time.perf_counter() - started
            print(f"{leak_config.streams} streams per response class; server stopped after {leak_elapsed:.1f} s")
        """),
        check("print(leak.report(leak_tables))"),
        ignore("leak_tables['outcome']"),
        ignore("""
            leak_figures = leak.plot(leak_tables)
            written = save_run(leak, leak_config, profile, leak_tables, leak_elapsed, leak_figures)
            print("figures:", ", ".join(p.name for p in written["figures"]), "| results:", written["results"])
        """),
        md("""
            The `full` profile runs 150 streams per response class, not the chapter's 300: on two CPU
            cores every prefill costs about a tenth of a second, and 300 streams twice would take longer
            than the whole of this notebook is allowed.

            ## Beside the chapter
        """),
        ignore("disconnect.beside_chapter(tables)"),
        ignore("print(disconnect.findings(tables))"),
        ignore("leak.beside_chapter(leak_tables)"),
        ignore("print(leak.findings(leak_tables))"),
        md("""
            What the two experiments say together: with a response that listens, a client's departure
            reaches the engine within about a step, and a request that was still waiting is never
            admitted. With a response that only writes, nothing leaks either, because every abandoned
            sequence finishes by itself and is released once; what it costs is the work, measured as
            tokens generated per token read and as the total time for the same plan. The checks are the
            part worth copying: they look at the cache, the registered streams and the number of
            releases, not only at whether the server still answers.
        """),
    ]


# --------------------------------------------------------------------------- 07 extensions


def extension_cells() -> list:
    return [
        md("""
            # 7. Extensions: the chapter's exercises, measured

            Five things the chapter argued or left as exercises, run on the lab's service:

            1. first-token delivery when each prefill ends, against at the end of the step;
            2. `pause_then_drop` under a full batch, at several stall timeouts, against `pause`;
            3. resuming a stream with `Last-Event-ID` after its client dropped the connection;
            4. the memory an eagerly formatting server would hold for four slow readers;
            5. identity under sampling with per-request seeds, and under bfloat16, reported by first
               divergence and the float32 model's logit margin there.
        """),
        setup("extensions"),
        serve_and_run("extensions"),
        md("## What must hold exactly"),
        check("print(extensions.report(tables))"),
        md("""
            ## First-token delivery

            N requests arrive together; they are admitted in one step and prefilled one after another.
        """),
        ignore("tables['delivery']"),
        md("""
            ## Pause, then drop, with the batch full

            Batch limit 4, two slow readers first, then fast requests. `pause` never lets go; each stall
            timeout of `pause_then_drop` trades slots held for slow clients cancelled.
        """),
        ignore("tables['saturation']"),
        md("""
            ## Resuming after a dropped connection

            With `resumable: true` a stream's events go to a bounded log and the run survives its
            connection for a grace period. The client leaves by RST after N tokens, waits, and asks for
            the events after the last id it saw. The last row comes back after the grace period.
        """),
        ignore("tables['resume']"),
        md("## Eager formatting: memory held for four slow readers"),
        ignore("tables['eager']"),
        md("""
            ## Identity under sampling and in bfloat16

            Where two runs split, `margin` is the float32 model's logit for the reference run's token
            minus the other's, after the tokens both share; `top2_margin` the gap between its best two.
        """),
        ignore("tables['identity_summary']"),
        ignore("tables['identity'].loc[~tables['identity'].identical]"),
        save("extensions"),
        md("## Beside the chapter"),
        ignore("extensions.beside_chapter(tables)"),
        md("""
            Resumption costs the server a log of every event for as long as the grace period lasts, and
            it keeps the run going for a client that may never come back; the checked cell shows that
            what it replays is exact. Seeded sampling is as reproducible as greedy decoding here because
            each request owns its generator and the engine's batched arithmetic does not depend on the
            neighbours; bfloat16 is compared the same way, and where it departs from float32 the margin
            says whether a near tie was broken differently.
        """),
    ]


def stable_ids(name: str, cells: list) -> list:
    """Name cells by notebook and position, so regenerating a notebook does not churn its diff."""
    stem = name.split("_")[0]
    for i, cell in enumerate(cells):
        cell["id"] = f"nb{stem}-{i:02d}"
    return cells


def main(argv: list[str]) -> None:
    for name, cells in notebooks().items():
        if not argv or any(name.startswith(prefix) for prefix in argv):
            print("wrote", write_notebook(name, stable_ids(name, cells)).relative_to(HERE.parent))


if __name__ == "__main__":
    main(sys.argv[1:])
