// ragsnap playground: documents in, POST /v1/answer as Server-Sent Events, the answer as it
// streams, citations whose quotes highlight in the document, and the kept-token heat map.
// No framework, no build step, nothing loaded from elsewhere.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const KEY_STORE = "ragsnap.apiKey";
  const state = {
    documents: [], // [{id, title, text}] as sent with the last question
    kept: new Map(), // doc id -> {spans, kept_share}
    citations: [],
    controller: null,
  };
  window.playground = state; // for the browser test and for curious users

  // -- the API key: typed once per tab (sessionStorage), sent as a bearer token ----------
  const keyInput = $("api-key");
  keyInput.value = sessionStorage.getItem(KEY_STORE) || "";
  keyInput.addEventListener("input", () => sessionStorage.setItem(KEY_STORE, keyInput.value));

  function headers() {
    const out = { "Content-Type": "application/json", Accept: "text/event-stream, application/json" };
    const key = keyInput.value.trim();
    if (key) out.Authorization = `Bearer ${key}`;
    return out;
  }

  async function errorMessage(response) {
    try {
      const body = await response.json();
      return body.error ? body.error.message : `HTTP ${response.status}`;
    } catch {
      return `HTTP ${response.status}`;
    }
  }

  function showError(message) {
    const box = $("error");
    box.textContent = message;
    box.hidden = !message;
  }

  // -- document editors ---------------------------------------------------------------
  function addDocument(title = "", text = "", id = null) {
    const node = $("document-template").content.firstElementChild.cloneNode(true);
    node.querySelector(".doc-title").value = title;
    node.querySelector(".doc-text").value = text;
    if (id !== null) node.dataset.id = id;
    node.querySelector(".remove").addEventListener("click", () => node.remove());
    $("documents").append(node);
    return node;
  }

  function readDocuments() {
    const out = [];
    const seen = new Set();
    for (const node of $("documents").querySelectorAll(".document")) {
      const text = node.querySelector(".doc-text").value;
      if (!text.trim()) continue;
      let id = node.dataset.id || String(out.length + 1);
      while (seen.has(id)) id = `${id}-${out.length + 1}`;
      seen.add(id);
      out.push({ id, title: node.querySelector(".doc-title").value, text });
    }
    return out;
  }

  $("add-document").addEventListener("click", () => addDocument());
  $("upload").addEventListener("change", async (event) => {
    for (const file of event.target.files) addDocument(file.name, await file.text());
    event.target.value = "";
  });

  // -- corpus search (shown when the server has a corpus) ------------------------------
  async function checkServer() {
    try {
      const response = await fetch("/readyz");
      const body = await response.json();
      $("server-status").textContent =
        body.status === "ready" ? `${body.model} on ${body.device}` : `model ${body.status}`;
      $("search-box").hidden = !body.corpus_passages;
    } catch {
      $("server-status").textContent = "the server does not answer";
    }
  }

  $("search-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    showError("");
    const response = await fetch("/v1/search", {
      method: "POST",
      headers: headers(),
      body: JSON.stringify({ query: $("search-query").value }),
    });
    if (!response.ok) return showError(await errorMessage(response));
    const { passages } = await response.json();
    const list = $("search-results");
    list.replaceChildren();
    if (!passages.length) list.append(item("no passage matches", "muted"));
    for (const passage of passages) {
      const li = item("", "passage");
      const add = button("Add", "add-passage");
      add.addEventListener("click", () => {
        addDocument(passage.title, passage.text, passage.id);
        add.disabled = true;
      });
      const label = document.createElement("span");
      label.textContent = `${passage.title || passage.id} (${passage.score.toFixed(2)}): ${passage.text.slice(0, 120)}`;
      li.append(add, " ", label);
      list.append(li);
    }
  });

  // -- asking: POST /v1/answer, read the event stream ----------------------------------
  function requestBody(documents) {
    const body = {
      question: $("question").value,
      documents,
      stream: true,
      kept_tokens: true,
      citations: { mode: "attribution" },
    };
    const maxTokens = parseInt($("max-tokens").value, 10);
    if (maxTokens > 0) body.max_new_tokens = maxTokens;
    const compression = {};
    if ($("press").value) compression.press = $("press").value;
    for (const [field, input] of [["budget", "budget"], ["window", "window"]]) {
      const value = parseInt($(input).value, 10);
      if (value > 0) compression[field] = value;
    }
    if (Object.keys(compression).length) body.compression = compression;
    return body;
  }

  // Server-Sent Events from a fetch body (EventSource cannot POST): yields {event, data}
  async function* readEvents(response) {
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      let cut;
      while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
        let event = "message";
        const data = [];
        for (const line of block.split(/\r?\n/)) {
          if (line.startsWith("event:")) event = line.slice(6).trim();
          else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
        }
        if (data.length) yield { event, data: JSON.parse(data.join("\n")) };
      }
    }
  }

  $("ask-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    const documents = readDocuments();
    if (!documents.length) return showError("add at least one document");
    startAnswer(documents);
    state.controller = new AbortController();
    try {
      const response = await fetch("/v1/answer", {
        method: "POST",
        headers: headers(),
        body: JSON.stringify(requestBody(documents)),
        signal: state.controller.signal,
      });
      if (!response.ok) {
        showError(await errorMessage(response));
        return;
      }
      for await (const { event: name, data } of readEvents(response)) {
        if (name === "meta") onMeta(data);
        else if (name === "token") $("answer").append(data.text);
        else if (name === "citations") renderCitations(data.citations);
        else if (name === "done") onDone(data);
        else if (name === "error") showError(data.error ? data.error.message : "the answer failed");
      }
    } catch (error) {
      if (error.name !== "AbortError") showError(String(error.message || error));
    } finally {
      endAnswer();
    }
  });

  $("stop").addEventListener("click", () => state.controller && state.controller.abort());

  function startAnswer(documents) {
    showError("");
    state.documents = documents;
    state.kept = new Map();
    state.citations = [];
    $("answer").textContent = "";
    $("verdict").textContent = "";
    $("answer").classList.add("streaming");
    $("answer").dataset.state = "streaming";
    $("citations").replaceChildren(item("waiting for the answer", "muted"));
    $("stats").replaceChildren();
    $("ask").disabled = true;
    $("stop").disabled = false;
    renderDocuments();
  }

  function endAnswer() {
    $("answer").classList.remove("streaming");
    if ($("answer").dataset.state === "streaming") $("answer").dataset.state = "ended";
    $("ask").disabled = false;
    $("stop").disabled = true;
    state.controller = null;
  }

  function onMeta(meta) {
    renderStats({
      cache: meta.cache,
      "prompt tokens": meta.prompt_tokens,
      "kept per head": meta.kept_tokens ?? "after compression", // null: sent before it
    });
  }

  function onDone(done) {
    renderAnswer(done); // the final text (a stop string may cut it), unsupported sentences marked
    $("answer").dataset.state = "done";
    renderCitations(done.citations);
    for (const doc of done.kept_tokens || []) state.kept.set(doc.doc_id, doc);
    const s = done.stats;
    const ms = (seconds) => (seconds == null ? "-" : `${(1000 * seconds).toFixed(0)} ms`);
    renderStats({
      cache: s.cache,
      press: s.press,
      "prompt tokens": s.prompt_tokens,
      "kept per head": s.kept_tokens,
      "KV kept": `${(s.kv_bytes_kept / 1024).toFixed(0)} of ${(s.kv_bytes_full / 1024).toFixed(0)} KiB`,
      prefill: ms(s.prefill_s),
      compress: ms(s.compress_s),
      "cache load": ms(s.cache_load_s),
      "first token": ms(s.ttft_s),
      "decode per token": s.decode_ms_per_token == null ? "-" : `${s.decode_ms_per_token} ms`,
      attribution: ms(s.attribution_s),
      total: ms(s.total_s),
      "new tokens": s.new_tokens,
    });
    renderDocuments();
  }

  // -- the verdict (issue 43): sentences no quote backs are marked; an abstention shows the
  // model's own answer under it ------------------------------------------------------------
  function renderAnswer(done) {
    const spoken = done.model_answer == null ? done.answer : done.model_answer;
    const marked = document.createElement("span");
    let at = 0;
    for (const [start, end] of done.unsupported_sentences || []) {
      marked.append(spoken.slice(at, start));
      const mark = document.createElement("mark");
      mark.className = "unsupported";
      mark.title = "no quote backs this sentence";
      mark.textContent = spoken.slice(start, end);
      marked.append(mark);
      at = end;
    }
    marked.append(spoken.slice(at));
    const answer = $("answer");
    if (done.model_answer == null) {
      answer.replaceChildren(marked);
    } else {
      marked.className = "model-answer muted";
      marked.prepend("the model answered: ");
      answer.replaceChildren(done.answer, marked);
    }
    const verdict = $("verdict");
    verdict.dataset.grounded = String(done.grounded);
    verdict.textContent =
      done.grounded == null
        ? "grounded: nothing to check"
        : `grounded: ${done.grounded ? "yes" : "no"} (${(100 * done.grounded_score).toFixed(0)}% of what the answer says is in its quotes)`;
    const invented = done.answer_not_in_documents || [];
    if (invented.length) verdict.textContent += `; the answer names what no document mentions: ${invented.join(", ")}`;
    const unnamed = done.not_in_documents || [];
    if (unnamed.length) verdict.textContent += `; the documents never mention ${unnamed.join(", ")}`;
  }

  function renderStats(values) {
    const list = $("stats");
    list.replaceChildren();
    for (const [name, value] of Object.entries(values)) {
      const dt = document.createElement("dt");
      dt.textContent = name;
      const dd = document.createElement("dd");
      dd.textContent = String(value);
      dd.dataset.stat = name;
      list.append(dt, dd);
    }
  }

  // -- citations ------------------------------------------------------------------------
  function renderCitations(citations) {
    state.citations = citations;
    const list = $("citations");
    list.replaceChildren();
    if (!citations.length) list.append(item("the answer cites no document", "muted"));
    for (const citation of citations) {
      const li = item("", "citation");
      const head = button(`[${citation.index}] ${citation.title || citation.doc_id}`, "cite");
      head.dataset.docId = citation.doc_id;
      const best = citation.quotes[0];
      head.addEventListener("click", () => best && highlight(citation.doc_id, best.start, best.end));
      li.append(head);
      const info = document.createElement("span");
      info.className = "muted";
      const parts = [citation.source];
      if (citation.score != null) parts.push(`score ${citation.score.toFixed(2)}`);
      if (citation.kept_share != null) parts.push(`kept ${(100 * citation.kept_share).toFixed(0)}%`);
      if (citation.supported === false) {
        li.classList.add("unsupported");
        const missing = (citation.unsupported || []).map((span) => span.text);
        parts.push(missing.length ? `unsupported: not in its quotes: ${missing.join(", ")}` : "unsupported");
      }
      info.textContent = ` ${parts.join(", ")}`;
      li.append(info);
      const quotes = document.createElement("ul");
      for (const quote of citation.quotes) {
        const q = item("", "");
        const b = button(`“${quote.text}”`, "quote");
        Object.assign(b.dataset, { docId: citation.doc_id, start: quote.start, end: quote.end });
        b.title = `characters ${quote.start} to ${quote.end}`;
        b.addEventListener("click", () => highlight(citation.doc_id, quote.start, quote.end));
        q.append(b);
        quotes.append(q);
      }
      li.append(quotes);
      list.append(li);
    }
  }

  function highlight(docId, start, end) {
    for (const other of document.querySelectorAll(".quote.active")) other.classList.remove("active");
    const view = renderDocument(docId, { start, end });
    if (!view) return;
    const mark = view.querySelector("mark.quote-highlight");
    if (mark) mark.scrollIntoView({ block: "center", behavior: "smooth" });
    for (const b of document.querySelectorAll(".quote")) {
      if (b.dataset.docId === docId && +b.dataset.start === start && +b.dataset.end === end) {
        b.classList.add("active");
      }
    }
  }

  // -- documents with the kept-token heat map and the highlighted quote -----------------
  function renderDocuments() {
    $("doc-views").replaceChildren();
    for (const doc of state.documents) renderDocument(doc.id, null);
  }

  function renderDocument(docId, quote) {
    const doc = state.documents.find((d) => d.id === docId);
    if (!doc) return null;
    let view = document.querySelector(`.doc-view[data-doc-id="${CSS.escape(docId)}"]`);
    if (!view) {
      view = document.createElement("article");
      view.className = "doc-view";
      view.dataset.docId = docId;
      $("doc-views").append(view);
    }
    const kept = state.kept.get(docId);
    const heading = document.createElement("h3");
    heading.textContent = doc.title || `document ${doc.id}`;
    if (kept) heading.append(` — kept ${(100 * kept.kept_share).toFixed(0)}% on average`);
    const body = document.createElement("div");
    body.className = "doc-text-view";
    body.append(...segments(doc.text, kept ? kept.spans : [], quote));
    view.replaceChildren(heading, body);
    return view;
  }

  // the text cut at every token and quote boundary; tokens shaded, the quote in a <mark>
  function segments(text, spans, quote) {
    const cuts = new Set([0, text.length]);
    for (const s of spans) cuts.add(s.start).add(s.end);
    if (quote) cuts.add(quote.start).add(quote.end);
    const points = [...cuts].filter((c) => c >= 0 && c <= text.length).sort((a, b) => a - b);
    const out = [];
    let mark = null;
    let si = 0;
    for (let i = 0; i + 1 < points.length; i++) {
      const [a, b] = [points[i], points[i + 1]];
      while (si < spans.length && spans[si].end <= a) si++;
      const span = si < spans.length && spans[si].start <= a ? spans[si] : null;
      let node;
      if (span) {
        node = document.createElement("span");
        node.className = span.share > 0 ? "tok kept" : "tok dropped";
        node.dataset.share = span.share;
        node.style.backgroundColor = shade(span.share);
        node.title = `kept by ${(100 * span.share).toFixed(0)}% of layers x heads`;
        node.textContent = text.slice(a, b);
      } else {
        node = document.createTextNode(text.slice(a, b));
      }
      const inside = quote && a >= quote.start && b <= quote.end;
      if (inside) {
        if (!mark) {
          mark = document.createElement("mark");
          mark.className = "quote-highlight";
          Object.assign(mark.dataset, { start: quote.start, end: quote.end });
          out.push(mark);
        }
        mark.append(node);
      } else {
        out.push(node);
      }
    }
    return out;
  }

  // 0 -> pale grey, 1 -> strong green
  function shade(share) {
    const s = Math.min(1, Math.max(0, share));
    const mix = (lo, hi) => Math.round(lo + (hi - lo) * s);
    return `rgb(${mix(236, 46)}, ${mix(236, 160)}, ${mix(236, 67)})`;
  }

  function item(text, className) {
    const li = document.createElement("li");
    if (className) li.className = className;
    li.textContent = text;
    return li;
  }

  function button(text, className) {
    const b = document.createElement("button");
    b.type = "button";
    b.className = className;
    b.textContent = text;
    return b;
  }

  for (const swatch of document.querySelectorAll(".swatch")) {
    swatch.style.backgroundColor = shade(+swatch.dataset.level / 10);
  }
  addDocument();
  checkServer();
})();
