// The trace report's browser side: filters and rows of the trace list, the flipped questions of the comparison.
// The data is the JSON in #report-data (searchr1_trl/report/traces.py names its keys). Rows are built a page at a
// time and a trace's turns only when its row is opened, so 5,000 traces load and filter at once.
"use strict";
(function () {
  const PAGE = 200;
  const data = JSON.parse(document.getElementById("report-data").textContent);
  const traces = data.traces;
  const sets = data.sets;
  const multiFolder = new Set(sets.map((s) => s.folder)).size > 1;

  function el(tag, className, ...children) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : String(child));
    }
    return node;
  }

  function setName(index) {
    const s = sets[index];
    return multiFolder ? s.folder + ": " + s.label : s.label;
  }

  // The snippet's text with its golden-answer spans in <mark>.
  function highlighted(text, spans) {
    const node = el("span", "snippet");
    let at = 0;
    for (const [start, end] of spans) {
      if (start < at) continue;
      node.append(text.slice(at, start), el("mark", null, text.slice(start, end)));
      at = end;
    }
    node.append(text.slice(at));
    return node;
  }

  // A trace's turns: each model turn with its queries, each search result's passages, gold titles marked.
  function conversation(t) {
    const box = el("div", "conversation");
    box.append(el("div", null, el("b", null, "Question: "), t.q, "  ", el("b", null, "Gold: "), t.g.join(" | ")));
    if (!t.turns.length) box.append(el("p", "empty", "(no conversation recorded)"));
    for (const turn of t.turns) {
      if (turn.r === "a") {
        const div = el("div", "turn model");
        if (turn.x) div.append(el("pre", null, turn.x));
        for (const query of turn.c) div.append(el("div", null, "search: ", el("span", "query", query)));
        box.append(div);
      } else if (turn.p) {
        const list = el("ol", "passages");
        for (const p of turn.p) {
          const item = el("li", null, el("span", p.gold ? "title gold" : "title", p.t));
          if (p.x !== undefined) item.append(" ", highlighted(p.x, p.h || []));
          list.append(item);
        }
        box.append(el("div", "turn result", list));
      } else {
        box.append(el("div", "turn result", el("pre", null, turn.x)));
      }
    }
    const end = el("div", null, el("b", null, "Answer: "), t.a === null ? "(none)" : t.a, "  ",
      el("span", t.em ? "ok" : "no", t.em ? "EM 1" : "EM 0"), "  F1 " + t.f1.toFixed(2) + "  status " + t.st,
      t.ct ? "  · " + t.ct + " call(s) closed by the engine" : "", t.smp ? "  · " + t.smp : "");
    box.append(end);
    return box;
  }

  // ---- the trace list ----
  const filter = {
    set: document.getElementById("f-set"), source: document.getElementById("f-source"),
    status: document.getElementById("f-status"), outcome: document.getElementById("f-outcome"),
    searches: document.getElementById("f-searches"), text: document.getElementById("f-text"),
  };
  function options(select, values, label) {
    for (const value of values) select.append(new Option(label ? label(value) : String(value), String(value)));
  }
  options(filter.set, sets.map((_, i) => i), setName);
  options(filter.source, [...new Set(traces.map((t) => t.src))].sort());
  options(filter.status, [...new Set(traces.map((t) => t.st))].sort());
  options(filter.searches, [...new Set(traces.map((t) => t.ns))].sort((x, y) => x - y));
  document.getElementById("total").textContent = traces.length;

  const body = document.querySelector("#trace-table tbody");
  const more = document.getElementById("more");
  let matching = [];
  let shown = 0;

  function matches(t) {
    const text = filter.text.value.trim().toLowerCase();
    return (filter.set.value === "" || t.s === Number(filter.set.value)) &&
      (filter.source.value === "" || t.src === filter.source.value) &&
      (filter.status.value === "" || t.st === filter.status.value) &&
      (filter.outcome.value === "" || t.em === Number(filter.outcome.value)) &&
      (filter.searches.value === "" || t.ns === Number(filter.searches.value)) &&
      (text === "" || t.q.toLowerCase().includes(text) || (t.a || "").toLowerCase().includes(text));
  }

  function row(t) {
    const tr = el("tr", "trace", el("td", null, setName(t.s)), el("td", null, t.src), el("td", null, t.q),
      el("td", null, t.g.join(" | ")), el("td", null, t.a === null ? "—" : t.a),
      el("td", t.em ? "ok" : "no", t.em ? "✓" : "✗"), el("td", null, t.f1.toFixed(2)), el("td", null, t.ns),
      el("td", t.st === "done" ? "st-done" : "st-other", t.st));
    tr.addEventListener("click", () => {
      const next = tr.nextElementSibling;
      if (next && next.classList.contains("detail")) {
        next.remove();
        tr.classList.remove("open");
        return;
      }
      const cell = el("td", null, conversation(t));
      cell.colSpan = 9;
      tr.after(el("tr", "detail", cell));
      tr.classList.add("open");
    });
    return tr;
  }

  function showMore() {
    const rows = matching.slice(shown, shown + PAGE).map((i) => row(traces[i]));
    body.append(...rows);
    shown += rows.length;
    more.hidden = shown >= matching.length;
  }

  function applyFilters() {
    matching = [];
    for (let i = 0; i < traces.length; i++) if (matches(traces[i])) matching.push(i);
    body.replaceChildren();
    shown = 0;
    showMore();
    document.getElementById("shown").textContent = matching.length;
  }

  for (const control of Object.values(filter)) control.addEventListener("input", applyFilters);
  more.addEventListener("click", showMore);
  applyFilters();

  // ---- the comparison ----
  const comparison = data.comparison;
  if (comparison && comparison.matched) {
    const flips = [...comparison.gained.map((p) => [...p, "gained"]), ...comparison.lost.map((p) => [...p, "lost"])];
    const box = document.getElementById("flips");
    const kind = document.getElementById("flip-kind");
    const flipsMore = document.getElementById("flips-more");
    let flipsShown = 0;
    let kept = [];

    function flip([a, b, tag]) {
      const head = el("div", "flip-head", el("span", "tag " + tag, tag), traces[a].q);
      const side = (i, name) => el("div", null, el("div", null, el("b", null, name)), conversation(traces[i]));
      const card = el("div", "flip", head, el("div", "flip-body", side(a, comparison.a), side(b, comparison.b)));
      card.dataset.question = traces[a].q;
      return card;
    }
    function showFlips() {
      const cards = kept.slice(flipsShown, flipsShown + PAGE / 4).map(flip);
      box.append(...cards);
      flipsShown += cards.length;
      flipsMore.hidden = flipsShown >= kept.length;
    }
    function filterFlips() {
      kept = flips.filter((f) => kind.value === "all" || f[2] === kind.value);
      box.replaceChildren();
      flipsShown = 0;
      showFlips();
      document.getElementById("flips-shown").textContent = kept.length;
    }
    kind.addEventListener("input", filterFlips);
    flipsMore.addEventListener("click", showFlips);
    filterFlips();
  }
  document.body.dataset.ready = "1";
})();
