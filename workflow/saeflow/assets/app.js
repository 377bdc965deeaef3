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
    $("meta").textContent = `layer ${D.meta.layer} | ${nLatents} latents | ${D.meta.n_rows} tokens | ` +
      `NMSE ${fmt(m.nmse)} | L0 ${fmt(m.l0)} | dead ${m.n_dead} | dense ${m.n_dense} | shards ${D.meta.shard_hash.slice(0, 12)}`;
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
    if (!d) {
      parts.push("<p>not drawn; choose it with <code>saeflow visuals --selection list --latents " + i + "</code></p>");
    } else {
      if (d.png) parts.push(`<img id="latent-png" src="${d.png}" alt="top examples of latent ${i}">`);
      if (d.contexts) {
        for (const c of d.contexts) {
          const mx = Math.max(...c.acts, 1e-12);
          const spans = c.tokens.map((t, j) => {
            const a = Math.max(0, c.acts[j]) / mx;
            const top = c.offset + j === c.token ? ' class="top"' : "";
            return `<span${top} style="background: rgba(255,120,0,${a.toFixed(3)})" title="${c.acts[j]}">${escapeHtml(t)}</span>`;
          });
          parts.push(`<div class="ctx">ex ${c.example}: ${spans.join("")}</div>`);
        }
      }
      parts.push("<table><tr><th>rank</th><th>example</th><th>token</th><th>value</th></tr>" +
        d.top.map((r, j) => `<tr><td>${j + 1}</td><td>${r[0]}</td><td>${r[1]}</td><td>${fmt(r[2])}</td></tr>`).join("") +
        "</table>");
    }
    box.innerHTML = parts.join("");
    renderRows();
  }

  $("list").addEventListener("scroll", () => window.requestAnimationFrame(renderRows));
  $("rows").addEventListener("click", (ev) => {
    const row = ev.target.closest(".row");
    if (row) location.hash = "latent-" + row.dataset.id;
  });
  $("search").addEventListener("keydown", (ev) => {
    if (ev.key !== "Enter") return;
    const i = Number(ev.target.value.trim());
    if (!Number.isInteger(i)) { $("latent").innerHTML = '<p class="error">type a latent id (a whole number)</p>'; return; }
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
