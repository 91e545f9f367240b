"""Write notebooks 01-04 from the cells below, without outputs.

    python notebooks/build_notebooks.py            # all four
    python notebooks/build_notebooks.py 03         # only those whose file name starts with 03

The notebooks are thin on purpose: the package computes (``labkit.experiments``), the notebook
narrates. Cells whose output changes from run to run start with ``# NBVAL_IGNORE_OUTPUT``; cells
that print an invariant in stable text start with ``# NBVAL_CHECK_OUTPUT`` and are compared by
``pytest --nbval-lax``. Run them in place (``make lab``) to fill in real outputs.

The helpers (``md``, ``code``, ``ignore``, ``check``, ``setup``, ``serve_and_run``, ``save``,
``write_notebook``) are meant for the other generators in this folder too.
"""
from __future__ import annotations

import sys
from pathlib import Path
from textwrap import dedent

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent
IGNORE, CHECK = "# NBVAL_IGNORE_OUTPUT", "# NBVAL_CHECK_OUTPUT"
METADATA = {
    "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
    "language_info": {"name": "python"},
}


def md(text: str):
    return new_markdown_cell(dedent(text).strip())


def code(src: str):
    return new_code_cell(dedent(src).strip())


def ignore(src: str):
    """A cell whose output varies (times, sizes, addresses): nbval runs it but does not compare."""
    return code(f"{IGNORE}\n{dedent(src).strip()}")


def check(src: str):
    """A cell that prints an invariant in stable text: nbval compares its output exactly."""
    return code(f"{CHECK}\n{dedent(src).strip()}")


def setup(module: str):
    return ignore(f"""
        import time

        import labkit
        from labkit.experiments import chapter, {module}
        from labkit.experiments.common import save_run, setup_notebook

        profile = setup_notebook()
        config = {module}.Config.for_profile(profile)
        config
    """)


def serve_and_run(module: str):
    return ignore(f"""
        started = time.perf_counter()
        with labkit.serve_in_thread(**{module}.server_options(config)) as server:
            print(f"serving {{server.engine.model.name}} at {{server.url}}, batch limit {{server.config.engine.max_batch}}")
            tables = {module}.run(config, server=server)
        elapsed = time.perf_counter() - started
        print(f"server stopped after {{elapsed:.1f}} s")
    """)


def save(module: str):
    return ignore(f"""
        figures = {module}.plot(tables)
        written = save_run({module}, config, profile, tables, elapsed, figures)
        print("figures:", ", ".join(p.name for p in written["figures"]), "| results:", written["results"])
    """)


def write_notebook(name: str, cells: list) -> Path:
    path = HERE / name
    notebook = new_notebook(cells=cells, metadata=METADATA)
    nbformat.validate(notebook)
    nbformat.write(notebook, path)
    return path


def notebooks() -> dict[str, list]:
    return {
        "01_wire_format.ipynb": wire_cells(),
        "02_isolation.ipynb": isolation_cells(),
        "03_overlap.ipynb": overlap_cells(),
        "04_buffers.ipynb": buffers_cells(),
    }


# --------------------------------------------------------------------------- 01 wire


def wire_cells() -> list:
    return [
        md("""
            # 1. What goes over the wire

            A streamed answer is one HTTP response whose body keeps growing. Here every prompt is sent twice to the
            same server: once to `POST /v1/stream`, read event by event with a timed SSE reader, and
            once to `POST /v1/generate`, which answers with a single JSON document. For each stream we
            check what a client leans on (the content type, the request id in the header against the
            one in the `start` event, the order start, tokens, done, the same tokens, text, usage and
            finish reason as the JSON answer, a last event id that matches the count of events, nothing
            cut off at the end) and we count what the stream cost in bytes.
        """),
        setup("wire"),
        md("The server runs in a background thread for the length of the next cell and is stopped when it ends."),
        serve_and_run("wire"),
        md("""
            ## The checks

            One line per property. When every stream has it, the line reads the same under any profile;
            a failure would print how many streams broke it.
        """),
        check("print(wire.report(tables))"),
        ignore("tables['checks']"),
        md("""
            ## What a stream costs

            Bytes per token counts the whole stream (start and done included) against its tokens. Most
            of it is the token events themselves: an `event:` line, an `id:` line and a small JSON object
            with the token's index, id and text. The figure's right panel shows one event's size by kind.
        """),
        ignore("""
            cols = ["prompt", "tokens", "events", "bytes", "bytes_per_token", "empty_deltas", "ttft_s", "duration_s"]
            tables["streams"][cols].describe().loc[["min", "50%", "max"]]
        """),
        save("wire"),
        md("""
            ## Beside the chapter

            The chapter ran this experiment with GPT-2 small on a GPU. Its wire cost does not depend on
            the hardware: it is set by the schema and by how long the ids and text of each token are, so
            ours should land near it, moved only by the tokenizer and the kind of text the model writes.
        """),
        ignore("chapter.wire_beside(tables)"),
        md("""
            A stream that passes every check can be read by any client that follows the SSE rules: one
            `start`, the tokens in order, exactly one terminal event, and a last event id that says how
            many events arrived, which is what a reconnecting client sends back. Per-token cost is only
            compared over streams that ran to their limit: SmolLM2-Instruct, given a bare prompt rather
            than its chat template, ends a few answers at once with its end-of-sequence token, and such a
            stream spreads its `start` and `done` over one or two tokens. That closing token's event has
            no text and is not counted as an empty delta; a genuine empty delta would be a token holding
            only part of a character. At roughly seventy bytes a token, a few hundred tokens make a stream
            of tens of kilobytes; notebook 04 sets that against what the connection holds before a writer
            has to wait.
        """),
    ]


# --------------------------------------------------------------------------- 02 isolation


def isolation_cells() -> list:
    return [
        md("""
            # 2. Isolation: does a stream's answer depend on its neighbours?

            A batch decodes many sequences in one pass, and nothing in the arithmetic should let one row
            see another. But padding, tiling and the shape of a matrix product can change the order of a
            floating-point sum, and a different order can flip a near tie between two tokens. So we test
            it: each prompt is streamed alone first, then the first N prompts are streamed at once, N from
            1 up, several times, and every concurrent stream is compared token id by token id with its
            solo run. The engine computes its decode on fixed tiles of rows by default
            (`batch_invariant=True`), which is meant to make the comparison exact; here it is checked end
            to end, over HTTP, with greedy decoding.
        """),
        setup("isolation"),
        serve_and_run("isolation"),
        md("## The invariant"),
        check("print(isolation.report(tables))"),
        ignore("tables['levels']"),
        md("""
            Where a stream differs, the table below gives the first position where it left its solo run,
            the two tokens, and the reference model's logit margin between them (plain transformers, one
            sequence, no batch). A margin near zero means a near tie broken the other way; a large one
            would point to a bug. An empty table means there was nothing to explain.
        """),
        ignore("""
            streams = tables["streams"]
            streams.loc[~streams.identical, ["level", "repetition", "prompt", "first_diff", "solo_token",
                                             "concurrent_token", "margin", "top2_margin"]]
        """),
        save("isolation"),
        md("## Beside the chapter"),
        ignore("chapter.isolation_beside(tables)"),
        md("""
            The result covers greedy decoding in float32 on this engine and nothing more. Sampling with a
            per-request seed and lower precision are separate questions, taken up in notebook 07, where a
            divergence is reported the same way: first differing position and margin.
        """),
    ]


# --------------------------------------------------------------------------- 03 overlap


def overlap_cells() -> list:
    return [
        md("""
            # 3. Overlapping streams: what batching buys, and what a single stream pays

            The same server answers 1, 2, 4, ... streams sent at the same moment, each on its own
            connection, and we measure from the client's side: the makespan (first request sent to last
            stream ended), the aggregate tokens per second, the time to first token and the gap between
            tokens. The baseline is the same prompts run one after another, summed.

            Three expectations, taken from the chapter and tested here: aggregate throughput grows nearly
            with the number of streams while each stream's gap grows much less; the wait for a first token rises
            with how many requests arrive at once, because their prefills run one after
            another; and a request that joins while others run waits for the step in progress and its
            own prefill, and no more.
        """),
        setup("overlap"),
        md("This cell runs four measurements in turn; on the `full` profile it takes several minutes."),
        serve_and_run("overlap"),
        md("""
            ## Levels

            Medians over the repetitions of each level. `back_to_back_s` is the sum of the same prompts'
            solo runs; `speedup` divides it by the makespan. Requests that arrive together are admitted in
            one step and prefilled one after another, and each first token is handed over as its own
            prefill ends; so an early stream's first gap (first token to second) also holds every later
            prefill of that step, which is what lifts the p99 gap at the larger levels.
        """),
        ignore("tables['levels'].groupby('level').median(numeric_only=True).drop(columns='repetition')"),
        md("""
            ## Why the aggregate grows: the cost of a decode step

            The engine decodes every running sequence in one pass, so a step's cost is a fixed part plus a
            part per sequence. The line is fitted through the median step time (no prefill in it) at each
            batch size, measured on the served model beside a bare transformers forward.
        """),
        ignore("tables['step_cost']"),
        ignore("tables['step_fit']"),
        md("""
            ## Late joiners

            Short requests arrive at random moments while long streams are already decoding (every long
            stream has its first token before the first joiner is sent), and on an idle engine. The columns
            `background_running_*` confirm that the long streams were still running when each joiner was
            sent and when its first token came back; `joiners_running_at_send` counts the earlier joiners
            still running, since where a step is slow a short request lives long enough to overlap the
            next one even on an "idle" engine.
        """),
        ignore("overlap.joiners_table(tables['joiners'])"),
        ignore("""
            tables["joiners"].groupby("background")[["background_running_at_send", "joiners_running_at_send"]].agg(["min", "max"])
        """),
        md("""
            ## First-token delivery: at the end of its own prefill, or at the end of the step

            Many requests arriving together are admitted in one step and prefilled one after another. If
            every first token waits for the step to end, all of them arrive when the last prefill is done;
            if each is handed over as soon as its own prefill is done, the early ones arrive sooner and the
            last one no later. The chapter delivered at step end and left the other as an exercise; the
            hub here does both (`first_token="prefill"` or `"step_end"`).
        """),
        ignore("overlap.delivery_table(tables['delivery'])"),
        save("overlap"),
        md("""
            ## Beside the chapter

            The chapter's numbers come from a GPU, where a decode step is mostly fixed cost; on two CPU
            cores a step costs more and grows faster with the batch, so the ratios matter more than the
            absolute figures. The `full` profile runs the chapter's sizes (32 streams, 64 tokens).
        """),
        ignore("chapter.overlap_beside(tables)"),
        md("""
            How to read it: the speedup over back-to-back serving is the direct measure of what overlap
            buys, and the fitted line says where it comes from: when the per-sequence part of a step is
            small against the fixed part, a step for many costs little more than a step for one. The price
            is paid by each stream in its gap between tokens and, for requests that arrive together, in
            the time to first token. A late joiner's first token should cost about the rest of one step
            of the batch it joins plus its own prefill. It may grow with the number of running streams only
            as far as that step grows with the batch (see the fitted line); growth beyond that would mean
            joiners queue behind one another.
        """),
    ]


# --------------------------------------------------------------------------- 04 buffers


def buffers_cells() -> list:
    return [
        md("""
            # 4. Where backpressure begins

            Between the engine and a reader sit several buffers the application never sees: uvicorn's
            write buffer, the server's socket send buffer and the client's receive buffer. A client that
            connects, sends its request and then reads nothing shows how much they hold together. The
            server writes SSE events of a fixed size as fast as the connection takes them and times every
            write; the first write that does not return within the block threshold marks where the writer
            had to wait. Event sizes of about 133 B (an ordinary token event), 1 KiB, 16 KiB and 64 KiB.
        """),
        setup("buffers"),
        serve_and_run("buffers"),
        check("print(buffers.report(tables))"),
        ignore("tables['by_size']"),
        md("""
            `client_unread` is what sat in the client's own receive buffer when the writer blocked, read
            with `FIONREAD`; the rest of what was accepted waited on the server's side. The kernel's limits
            on those buffers (minimum, default, maximum, in bytes) bound the answer:
        """),
        ignore("tables['kernel']"),
        save("buffers"),
        md("## Beside the chapter"),
        ignore("chapter.buffers_beside(tables)"),
        ignore("""
            smallest = int(tables["by_size"].bytes_accepted_min.min())
            for per_token in (75, 64 * 1024 + 75):
                print(f"at {per_token:,} bytes per token, {smallest:,} bytes hold about {smallest // per_token:,} tokens")
        """),
        md("""
            The chapter found about a quarter to a third of a megabyte on its machine; Linux grows a
            socket's send buffer on its own (up to the `tcp_wmem` maximum) while data is queued, so on
            this stack the figure is a property of the kernel's settings, not of the application. Either
            way the consequence is the same: at seventy-odd bytes per token, a whole answer of a few
            hundred tokens fits in buffers long before a writer blocks, so a slow reader of ordinary token
            events never pushes back on the server. It takes large events, like the 64 KiB padding used in
            notebook 05, before a slow client is felt at all.
        """),
    ]


def main(argv: list[str]) -> None:
    sys.path.insert(0, str(HERE))
    for name, cells in notebooks().items():
        if not argv or any(name.startswith(prefix) for prefix in argv):
            print("wrote", write_notebook(name, cells).relative_to(HERE.parent))


if __name__ == "__main__":
    main(sys.argv[1:])
