"use strict";
// Notebook 10's clients inside a page (labkit.experiments.edge_browser injects this file into a
// page of the origin under test and calls these functions through Selenium). Every time is the
// page's performance.now() in milliseconds since the call began; every function is bounded by
// its timeoutMs and answers with what it saw, never throws.
window.edge = (() => {
  const since = (t0) => Math.round((performance.now() - t0) * 10) / 10;
  const sleep = (ms) => new Promise((ok) => setTimeout(ok, ms));

  // A fetch reader: WHATWG line splitting (CRLF, LF, CR), data/event/id fields, comments skipped.
  // onEvent returns false to stop reading (the caller aborts); the result says how it ended.
  async function readEvents(response, onEvent) {
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "", data = [], type = "message", id = "";
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) return "end";
        buffer += value;
        const lines = buffer.split(/\r\n|\r(?!$)|\n/);
        buffer = lines.pop();
        for (const line of lines) {
          if (line === "") {
            if (data.length && onEvent({ type, id, data: data.join("\n") }) === false) return "left";
            data = []; type = "message";
          } else if (!line.startsWith(":")) {
            const at = line.indexOf(":"), field = at < 0 ? line : line.slice(0, at);
            let v = at < 0 ? "" : line.slice(at + 1);
            if (v.startsWith(" ")) v = v.slice(1);
            if (field === "data") data.push(v); else if (field === "event") type = v; else if (field === "id") id = v;
          }
        }
      }
    } catch (e) {
      return "aborted";
    }
  }

  // 1. `count` EventSources to `streamPath` (each ends after `ticks` tick events and is closed
  // then, so it never reconnects), then one fetch of `fetchPath`, all from one origin.
  async function six({ streamPath, ticks, count, fetchPath, timeoutMs }) {
    const t0 = performance.now(), streams = [], sources = [];
    const request = { sent: null, answered: null, status: null };
    let left = count + 1;
    await new Promise((resolve) => {
      const finish = () => { if (--left === 0) resolve(); };
      setTimeout(resolve, timeoutMs);
      for (let i = 0; i < count; i++) {
        const row = { stream: i + 1, opened: null, first: null, last: null, events: 0, failed: false };
        streams.push(row);
        const es = new EventSource(`${streamPath}&stream=${i + 1}`);
        sources.push(es);
        es.onopen = () => { row.opened = since(t0); };
        es.addEventListener("tick", (e) => {
          row.events += 1;
          if (row.first === null) row.first = since(t0);
          if (JSON.parse(e.data).index === ticks - 1) { row.last = since(t0); es.close(); finish(); }
        });
        es.onerror = () => { row.failed = true; es.close(); finish(); };
      }
      // the fetch goes out once the streams that could open have opened (none for 300 ms more)
      const opened = () => streams.filter((r) => r.opened !== null);
      const settled = () => opened().length === count ||
        (opened().length > 0 && performance.now() - t0 - Math.max(...opened().map((r) => r.opened)) > 300);
      const send = () => {
        if (!settled()) { setTimeout(send, 25); return; }
        request.sent = since(t0);
        fetch(fetchPath, { cache: "no-store" })
        .then((r) => r.text().then(() => { request.status = r.status; }))
        .catch(() => { request.status = 0; })
        .finally(() => { request.answered = since(t0); finish(); });
      };
      send();
    });
    sources.forEach((es) => es.close());
    const protocols = new Set(performance.getEntriesByType("resource").map((e) => e.nextHopProtocol).filter((p) => p));
    const firstEnd = Math.min(...streams.map((r) => (r.last === null ? Infinity : r.last)));
    return {
      streams: streams.map((r) => ({ stream: r.stream, first_ms: r.first })),
      row: { protocol: [...protocols].sort().join(", "), fetch_ms: request.answered - request.sent,
             started_before_first_end: streams.filter((r) => r.first !== null && r.first < firstEnd).length,
             fetch_before_first_end: request.answered < firstEnd,
             failed: streams.filter((r) => r.failed).length + (request.status === 200 ? 0 : 1) },
    };
  }

  // 2. One EventSource on `url`: every open, event and error (with readyState) in order, until
  // it is CLOSED and `watchMs` more have passed (or `timeoutMs`).
  async function rules({ url, watchMs, timeoutMs }) {
    const t0 = performance.now(), log = [];
    const es = new EventSource(url);
    let closedAt = null;
    es.onopen = () => log.push({ kind: "open", t: since(t0) });
    for (const type of ["start", "token", "done"]) {
      es.addEventListener(type, (e) => log.push({ kind: type, id: e.lastEventId, t: since(t0) }));
    }
    es.onerror = () => {
      log.push({ kind: "error", state: es.readyState, t: since(t0) });
      if (es.readyState === EventSource.CLOSED && closedAt === null) closedAt = performance.now();
    };
    while (performance.now() - t0 < timeoutMs && (closedAt === null || performance.now() - closedAt < watchMs)) {
      await sleep(25);
    }
    es.close();
    return { log, row: session(log) };
  }

  // One EventSource's life: connections, events in order once, and the delays before reconnecting
  // after a cut (error, then the next open) and after the end (error after done, then the 204's).
  function session(log) {
    const at = (kind, test) => { const e = log.find((x) => x.kind === kind && test(x)); return e ? e.t : null; };
    const ids = log.filter((e) => ["start", "token", "done"].includes(e.kind)).map((e) => Number(e.id));
    const done = at("done", () => true) ?? Infinity;
    const cut = at("error", (e) => e.t < done && e.state === 0), end = at("error", (e) => e.t > done && e.state === 0);
    const closed = at("error", (e) => e.state === 2), reopened = cut === null ? null : at("open", (e) => e.t > cut);
    return { opens: log.filter((e) => e.kind === "open").length, events: ids.length, in_order_once: inOrder(ids),
             closed: closed !== null, cut_delay_ms: reopened === null ? null : reopened - cut,
             end_delay_ms: end === null || closed === null ? null : closed - end };
  }
  const inOrder = (ids) => ids.every((id, i) => id === i + 1);

  // 3. POST a resumable stream with a bearer token, leave after `cutAfter` events (a dropped
  // connection), wait until the token has expired, then resume with ?after=<last id>, refreshing
  // the token first if `refresh`. What a fetch reader without a retry loop does with a 401: stop.
  async function auth({ body, ttl, cutAfter, refresh, marginMs, timeoutMs }) {
    const t0 = performance.now(), events = [], answers = [];
    const token = async () => (await fetch(`/lab/token?ttl_s=${ttl}`, { method: "POST" })).json();
    const take = (e) => { events.push({ type: e.type, id: e.id, t: since(t0) }); };
    let grant = await token();
    const leave = new AbortController();
    const headers = (g) => ({ "content-type": "application/json", authorization: `Bearer ${g.token}` });
    const first = await fetch("/v1/stream", { method: "POST", body: JSON.stringify(body), headers: headers(grant),
                                              signal: leave.signal });
    answers.push({ leg: "post", status: first.status, t: since(t0), challenge: first.headers.get("www-authenticate") });
    const rid = first.headers.get("x-request-id"), resumeToken = first.headers.get("x-resume-token");
    await readEvents(first, (e) => { take(e); if (events.length >= cutAfter) { leave.abort(); return false; } });
    const lastId = events.length ? events[events.length - 1].id : "0";
    await sleep(Math.max(0, grant.expires_at * 1000 - Date.now()) + marginMs);
    if (refresh) grant = await token();
    const again = await fetch(`/v1/streams/${rid}/events?after=${lastId}`,
                              { headers: { ...headers(grant), "x-resume-token": resumeToken } });
    answers.push({ leg: "resume", status: again.status, t: since(t0), challenge: again.headers.get("www-authenticate") });
    let ended = `http ${again.status}`;
    if (again.status === 200) {
      const stop = new AbortController(), timer = setTimeout(() => stop.abort(), timeoutMs);
      ended = await readEvents(again, (e) => { take(e); return !stop.signal.aborted; });
      clearTimeout(timer);
    }
    const [post, back] = answers;
    return { events, row: { post: post.status, resume: back.status, challenge: back.challenge || "", ended,
                            tokens: events.filter((e) => e.type === "token").length, in_order_once: inOrder(events.map((e) => Number(e.id))),
                            done: events.length > 0 && events[events.length - 1].type === "done" } };
  }

  // 8. A fetch stream whose progress the driver polls (window.edge.state) and whose tab it closes.
  const state = { tokens: 0, status: null, request_id: null, ended: null };
  function stream({ path, body }) {
    fetch(path, { method: "POST", body: JSON.stringify(body), headers: { "content-type": "application/json" } })
      .then((r) => {
        state.status = r.status; state.request_id = r.headers.get("x-request-id");
        return readEvents(r, (e) => { if (e.type === "token") state.tokens += 1; });
      })
      .then((how) => { state.ended = how; }, () => { state.ended = "failed"; });
    return Promise.resolve(true);
  }

  return { six, rules, auth, stream, state, readEvents };
})();
