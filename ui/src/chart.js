// Plain SVG charts (no library): a line over time, and stacked bars per label.
const NS = "http://www.w3.org/2000/svg";

function svg(tag, attrs, ...children) {
  const el = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  for (const c of children) el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return el;
}

export function lineChart(title, points, max, w = 320, hgt = 110) {
  const top = Math.max(max || 0, ...points.map((p) => p[1]), 1);
  const fig = document.createElement("figure");
  fig.className = "chart";
  const cap = document.createElement("figcaption");
  const last = points.length ? points[points.length - 1][1] : null;
  cap.textContent = title + (last === null ? "" : `: ${Number(last).toFixed(1)}`);
  const t0 = points.length ? points[0][0] : 0;
  const t1 = points.length ? points[points.length - 1][0] : 1;
  const span = Math.max(t1 - t0, 1);
  const d = points.map((p, i) => `${i ? "L" : "M"}${((p[0] - t0) / span) * (w - 2) + 1},${hgt - 1 - (p[1] / top) * (hgt - 2)}`).join(" ");
  const chart = svg("svg", { viewBox: `0 0 ${w} ${hgt}`, role: "img", "aria-label": cap.textContent },
    svg("rect", { x: 0, y: 0, width: w, height: hgt, class: "bg" }),
    svg("path", { d: d || "M0,0", class: "line" }));
  fig.append(cap, chart);
  return fig;
}

// bars: [{label, parts: [value, ...]}], names: the parts' names (a legend)
export function barChart(title, bars, names, w = 640, hgt = 180) {
  const fig = document.createElement("figure");
  fig.className = "chart wide";
  const cap = document.createElement("figcaption");
  cap.textContent = title;
  const top = Math.max(1e-9, ...bars.map((b) => b.parts.reduce((a, x) => a + x, 0)));
  const bw = bars.length ? (w - 10) / bars.length : w;
  const g = [];
  bars.forEach((b, i) => {
    let y = hgt - 20;
    b.parts.forEach((v, j) => {
      const bh = (v / top) * (hgt - 30);
      y -= bh;
      g.push(svg("rect", { x: 5 + i * bw + 1, y, width: Math.max(bw - 2, 1), height: bh, class: "part" + j },
        svg("title", {}, `${b.label} ${names[j]}: ${v.toFixed(3)}`)));
    });
    if (bars.length <= 31) g.push(svg("text", { x: 5 + i * bw + bw / 2, y: hgt - 5, "text-anchor": "middle", class: "axis" }, b.short ?? b.label));
  });
  const legend = document.createElement("p");
  legend.className = "legend";
  names.forEach((n, j) => {
    const s = document.createElement("span");
    s.className = "key part" + j;
    s.textContent = n;
    legend.append(s);
  });
  fig.append(cap, svg("svg", { viewBox: `0 0 ${w} ${hgt}`, role: "img", "aria-label": title }, svg("rect", { x: 0, y: 0, width: w, height: hgt, class: "bg" }), ...g), legend);
  return fig;
}
