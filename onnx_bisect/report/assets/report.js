// report.html's node table: sort by a column, filter by verdict, op type and name.
// The filters can come from the address: report.html#verdict=culprit&op=Conv&name=down1
(function () {
  "use strict";
  // A wide graph opens scrolled to the root cause, not to the model's inputs.
  const centre = document.querySelector("svg.graph .centre");
  if (centre) {
    const box = centre.transform.baseVal.consolidate();
    centre.closest(".scroll").scrollLeft = Math.max(0, box.matrix.e - 80);
  }
  const table = document.getElementById("nodes");
  if (!table) return;
  const body = table.tBodies[0];
  const rows = Array.from(body.rows);
  const verdict = document.getElementById("f-verdict");
  const op = document.getElementById("f-op");
  const name = document.getElementById("f-name");
  const shown = document.getElementById("shown");

  function apply() {
    const v = verdict.value, o = op.value, q = name.value.trim().toLowerCase();
    let count = 0;
    for (const r of rows) {
      const keep = (!v || r.dataset.verdict === v) && (!o || r.dataset.op === o) &&
        (!q || r.dataset.name.toLowerCase().includes(q));
      r.hidden = !keep;
      if (keep) count += 1;
    }
    shown.textContent = count + " of " + rows.length + " nodes shown";
  }

  let sortedBy = null, ascending = true;
  function sortBy(th) {
    const col = th.cellIndex, numeric = th.dataset.type === "num";
    // Errors read worst first; names and the topological index read in order.
    ascending = th === sortedBy ? !ascending : !(numeric && th.dataset.desc === "1");
    sortedBy = th;
    const key = (r) => {
      const c = r.cells[col];
      return numeric ? (c.dataset.v === "" ? NaN : Number(c.dataset.v)) : c.textContent;
    };
    rows.sort((a, b) => {
      const x = key(a), y = key(b);
      if (!numeric) return ascending ? x.localeCompare(y) : y.localeCompare(x);
      if (Number.isNaN(x)) return Number.isNaN(y) ? 0 : 1;  // unknown values last
      if (Number.isNaN(y)) return -1;
      return ascending ? x - y : y - x;
    });
    body.append(...rows);
    for (const h of table.tHead.rows[0].cells) h.removeAttribute("aria-sort");
    th.setAttribute("aria-sort", ascending ? "ascending" : "descending");
  }

  table.tHead.addEventListener("click", (e) => {
    const th = e.target.closest("th");
    if (th) sortBy(th);
  });
  for (const el of [verdict, op, name]) el.addEventListener("input", apply);
  const wanted = new URLSearchParams(location.hash.slice(1));
  if (wanted.has("verdict")) verdict.value = wanted.get("verdict");
  if (wanted.has("op")) op.value = wanted.get("op");
  if (wanted.has("name")) name.value = wanted.get("name");
  apply();
  document.body.dataset.ready = "1";  // the browser test's sign that the script ran through
})();
