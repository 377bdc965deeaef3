// The latent browser: a lazily rendered (virtual) list of every latent, a detail view per latent.
// Data comes from data.js (window.SAEFLOW_DATA) so the page works from file:// without a server.
"use strict";
(function () {
  const D = window.SAEFLOW_DATA;
  const ROW_PX = 24;
  const nLatents = D.meta.d_sae;
  const $ = (id) => document.getElementById(id);
  const fmt = (x) => (x === null || x === undefined ? "-" : Number(x).toPrecision(3));
  let order = [];

  function renderMeta() {
    const m = D.meta.metrics || {};
    // The metrics and frequencies are over the tokens the SAE trained on (tokens: content, no_special, ...); a
    // transcoder's NMSE is of its prediction of the tensor it writes.
    const where = D.meta.writes
      ? `transcoder: reads ${D.meta.hook}, predicts ${D.meta.writes} of layer ${D.meta.layer}`
      : `${D.meta.hook} of layer ${D.meta.layer}`;
    $("meta").textContent = `${where} | ${nLatents} latents | on the ${D.meta.n_rows} tokens it ` +
      `trained on (tokens: ${D.meta.tokens}): NMSE${D.meta.writes ? " of its prediction" : ""} ${fmt(m.nmse)} | ` +
      `L0 ${fmt(m.l0)} | dead ${m.n_dead} | ` +
      `dense ${m.n_dense} | shards ${D.meta.shard_hash.slice(0, 12)}`;
  }

  function computeOrder() {
    const ids = [];
    const drawnOnly = $("drawn-only").checked;
    for (let i = 0; i < nLatents; i++) if (!drawnOnly || D.drawn[i]) ids.push(i);
    const sort = $("sort").value;
    if (sort === "freq-desc") ids.sort((a, b) => D.freq[b] - D.freq[a] || a - b);
    else if (sort === "freq-asc") ids.sort((a, b) => D.freq[a] - D.freq[b] || a - b);
    else if (sort === "mean-desc") ids.sort((a, b) => D.mean[b] - D.mean[a] || a - b);
    order = ids;
    $("count").textContent = `${order.length} latents`;
    $("spacer").style.height = order.length * ROW_PX + "px";
    renderRows();
  }

  function renderRows() {
    // Only the rows in view (plus a margin) exist in the DOM: thousands of latents stay fast.
    const list = $("list");
    const first = Math.max(0, Math.floor(list.scrollTop / ROW_PX) - 10);
    const last = Math.min(order.length, first + Math.ceil(list.clientHeight / ROW_PX) + 20);
    const rows = $("rows");
    rows.style.top = first * ROW_PX + "px";
    const current = currentLatent();
    const html = [];
    for (let j = first; j < last; j++) {
      const i = order[j];
      html.push(`<div class="row${i === current ? " active" : ""}" data-id="${i}" id="row-${i}">` +
        `<span>#${i}${D.drawn[i] ? ' <b class="drawn">●</b>' : ""}</span><span>${fmt(D.freq[i])}</span>` +
        `<span>${fmt(D.mean[i])}</span></div>`);
    }
    rows.innerHTML = html.join("");
  }

  function currentLatent() {
    const m = /^#latent-(\d+)$/.exec(location.hash);
    return m ? Number(m[1]) : null;
  }

  function escapeHtml(s) {
    return s.replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);
  }

  function renderContext(c) {
    // Text pieces as the tokenizer detokenizes them (leading spaces kept), special tokens marked, shaded by activation.
    const mx = Math.max(...c.acts, 1e-12);
    const special = new Set(c.special || []);
    const spans = c.tokens.map((t, j) => {
      const a = Math.max(0, c.acts[j]) / mx;
      const cls = [c.offset + j === c.token ? "top" : "", special.has(j) ? "special" : ""].filter(Boolean).join(" ");
      return `<span${cls ? ` class="${cls}"` : ""} style="background: rgba(255,120,0,${a.toFixed(3)})" ` +
        `title="activation ${c.acts[j]}">${escapeHtml(t)}</span>`;
    });
    return `<div class="ctx"><span class="ex">ex ${c.example}, token ${c.token}</span>${spans.join("")}</div>`;
  }

  function rowsTable(rows) {
    return "<table><tr><th>rank</th><th>example</th><th>token position</th><th>activation</th></tr>" +
      rows.map((r, j) => `<tr><td>${j + 1}</td><td>${r[0]}</td><td>${r[1]}</td><td>${fmt(r[2])}</td></tr>`).join("") +
      "</table>";
  }

  function histogram(h) {
    const mx = Math.max(...h.counts, 1);
    const bars = h.counts.map((n, j) => {
      const lo = (h.lo + (h.hi - h.lo) * j / h.counts.length).toPrecision(3);
      return `<div style="height:${(100 * n / mx).toFixed(1)}%" title="activation ${lo}..: ${n} tokens"></div>`;
    });
    const total = h.counts.reduce((a, b) => a + b, 0);
    return `<div class="hist">${bars.join("")}</div><div class="hist-axis"><span>0</span>` +
      `<span>activation (${total} firing tokens; bar height = count)</span><span>${fmt(h.hi)}</span></div>`;
  }

  function vocabTables(d) {
    const table = (title, rows) => `<div><h4>${title}</h4><table><tr><th>token</th><th>score</th></tr>` +
      rows.map((r) => `<tr><td>${escapeHtml(r[0])}</td><td>${fmt(r[1])}</td></tr>`).join("") + "</table></div>";
    const title = D.meta.writes
      ? `What it predicts: the tokens its output direction (written into ${D.meta.writes}) promotes and suppresses`
      : "Tokens the decoder direction promotes and suppresses";
    return `<section id="vocab"><h3>${escapeHtml(title)}</h3>` +
      `<p class="note">${escapeHtml(D.meta.vocab_note || "")}</p>` +
      `<div class="vocab">${table("promoted", d.promote)}${table("suppressed", d.suppress)}</div></section>`;
  }

  function labelsSection(i) {
    // saeflow probe: the labels among whose 20 latents of largest mean difference this latent is (labels.js).
    const L = window.SAEFLOW_LABELS || { labelled: false, latents: {} };
    if (!L.labelled) return "";  // shards without labels: nothing to predict
    const rows = L.latents[i] || [];
    let body;
    if (L.note) body = `<p class="note">${escapeHtml(L.note)}</p>`;
    else if (!rows.length) body = '<p class="note">none: it is not among the 20 latents of largest mean difference of any probed label</p>';
    else body = "<table><tr><th>label</th><th>held-out AUROC</th><th>rank by mean difference</th><th>best single latent</th></tr>" +
      rows.map((r) => `<tr><td>${escapeHtml(r[0])}</td><td>${fmt(r[1])}</td><td>${r[2]}</td><td>${r[3] ? "yes" : ""}</td></tr>`).join("") +
      "</table>";
    return `<section id="labels"><h3>Labels this latent predicts</h3>${body}</section>`;
  }

  function renderDrawn(i, d, parts) {
    if (d.promote) parts.push(vocabTables(d));
    else if (D.meta.vocab_note) parts.push(`<p class="note">${escapeHtml(D.meta.vocab_note)}</p>`);
    if (d.hist) parts.push(`<section id="histogram"><h3>Activation histogram</h3>${histogram(d.hist)}</section>`);
    const top = [`<section id="top"><h3>Top activations</h3>`];
    if (d.contexts) top.push(...d.contexts.map(renderContext));
    else if (d.png) top.push(`<img id="latent-png" src="${d.png}" alt="top examples of latent ${i}">`);
    top.push(rowsTable(d.top), "</section>");
    parts.push(top.join(""));
    if (d.quantiles && d.quantiles.length) {
      const q = ['<section id="quantiles"><h3>Examples sampled across the activation distribution</h3>'];
      for (const b of d.quantiles) {
        q.push(`<h4>quantile ${b.q[0]}-${b.q[1]}% of firing values (activation ${fmt(b.range[0])} to ${fmt(b.range[1])})</h4>`);
        if (b.contexts) q.push(...b.contexts.map(renderContext));
        else if (b.png) q.push(`<img class="quantile-png" src="${b.png}" alt="quantile ${b.q[0]}-${b.q[1]}%">`);
        else q.push('<p class="note">no examples in this band</p>');
      }
      q.push("</section>");
      parts.push(q.join(""));
    }
  }

  function renderLatent() {
    const i = currentLatent();
    const box = $("latent");
    if (i === null) { box.innerHTML = ""; return; }
    if (!(i >= 0 && i < nLatents)) {
      box.innerHTML = `<p class="error">no latent ${i}: ids are 0..${nLatents - 1}</p>`;
      return;
    }
    const d = D.drawn[i];
    const parts = [`<h2>latent ${i}</h2>`,
      `<p>firing frequency ${fmt(D.freq[i])} | mean activation when firing ${fmt(D.mean[i])} | max ${fmt(D.max[i])}</p>`];
    const labels = labelsSection(i);
    if (labels) parts.push(labels);
    if (!d) parts.push(`<p>not drawn; draw it beside the others with <code id="redraw">${escapeHtml(D.meta.redraw + " " + i)}</code></p>`);
    else renderDrawn(i, d, parts);
    box.innerHTML = parts.join("");
    renderRows();
  }

  function searchToken(text) {
    // Exact token first, else every indexed token that contains the text.
    const key = text.toLowerCase();
    const index = D.token_index || {};
    const keys = index[key] ? [key] : Object.keys(index).filter((k) => k.includes(key)).sort();
    const hits = keys.flatMap((k) => index[k].map((h) => [k, ...h]));
    const items = hits.map(([k, id, why]) => `<li><a href="#latent-${id}">latent ${id}</a>: "${escapeHtml(k)}" (${why})</li>`);
    $("latent").innerHTML = `<h2>token "${escapeHtml(text)}"</h2>` + (items.length
      ? `<p>drawn latents whose top activations or promoted tokens include it:</p><ul id="token-hits">${items.join("")}</ul>`
      : `<p class="error">no drawn latent has "${escapeHtml(text)}" among its top-activating or promoted tokens</p>`);
  }

  $("list").addEventListener("scroll", () => window.requestAnimationFrame(renderRows));
  $("rows").addEventListener("click", (ev) => {
    const row = ev.target.closest(".row");
    if (row) location.hash = "latent-" + row.dataset.id;
  });
  $("search").addEventListener("keydown", (ev) => {
    if (ev.key !== "Enter") return;
    const text = ev.target.value.trim();
    if (!text) return;
    const i = Number(text);
    if (!/^[0-9]+$/.test(text) || !Number.isInteger(i)) {
      if (location.hash) try { history.replaceState(null, "", location.pathname); } catch (e) { /* file:// */ }
      searchToken(text);
      return;
    }
    location.hash = "latent-" + i;
    const j = order.indexOf(i);
    if (j >= 0) $("list").scrollTop = j * ROW_PX;
  });
  $("sort").addEventListener("change", computeOrder);
  $("drawn-only").addEventListener("change", computeOrder);
  window.addEventListener("hashchange", renderLatent);
  renderMeta();
  computeOrder();
  renderLatent();
})();
