(function () {
  "use strict";
  const all = sel => Array.from(document.querySelectorAll(sel));
  const eps = all(".ep"), groups = all(".group"), stepSel = document.getElementById("step");
  const shown = document.getElementById("shown"), el = (tag, props) => Object.assign(document.createElement(tag), props);
  const envSel = document.getElementById("env"), envs = Array.from(new Set(eps.map(e => e.dataset.env))).sort();
  envs.forEach(v => envSel.append(el("option", {value: v, textContent: v})));
  all(".envs").forEach(x => { x.hidden = envs.length < 2; });  // a run of one environment needs no choice

  // the filter bar, from the episodes on the page: a box per status (known ones first), an option per file
  const count = new Map();
  eps.forEach(e => count.set(e.dataset.status, (count.get(e.dataset.status) || 0) + 1));
  const known = STATUSES.filter(s => count.has(s)), other = Array.from(count.keys()).filter(s => !STATUSES.includes(s)).sort();
  known.concat(other).forEach(s => {
    const label = el("label", {className: "badge s-" + s});
    label.append(el("input", {type: "checkbox", name: "status", value: s, checked: true}), " " + s + " (" + count.get(s) + ")");
    document.getElementById("boxes").append(label, " ");
  });
  PHASES.concat(["other"]).forEach(phase => {
    const mine = groups.filter(g => g.dataset.phase === phase);
    if (!mine.length) return;
    const og = el("optgroup", {label: phase});
    mine.forEach(g => og.append(el("option", {value: g.dataset.step, textContent: g.dataset.step + " (" + g.dataset.total + ")"})));
    stepSel.append(og);
  });
  document.getElementById("counts").textContent = eps.length + " episodes · " + groups.length + " steps";
  const boxes = all('input[name="status"]');

  function readHash() {  // #status=answered,timeout&step=step_00002&open=all
    const p = new URLSearchParams(location.hash.slice(1));
    if (p.has("status")) {
      const want = new Set(p.get("status").split(","));
      boxes.forEach(b => { b.checked = want.has(b.value); });
    }
    if (p.has("step") && Array.from(stepSel.options).some(o => o.value === p.get("step"))) {
      stepSel.value = p.get("step");
    }
    if (envs.includes(p.get("env"))) envSel.value = p.get("env");
    if (p.get("open") === "all") eps.forEach(e => { e.open = true; });
  }
  function writeHash() {
    const p = new URLSearchParams();
    if (boxes.some(b => !b.checked)) p.set("status", boxes.filter(b => b.checked).map(b => b.value).join(","));
    if (stepSel.value) p.set("step", stepSel.value);
    if (envSel.value) p.set("env", envSel.value);
    history.replaceState(null, "", p.toString() ? "#" + p.toString() : location.pathname);
  }
  function apply() {
    const on = new Set(boxes.filter(b => b.checked).map(b => b.value)), step = stepSel.value, env = envSel.value;
    eps.forEach(e => { e.hidden = !(on.has(e.dataset.status) && (step === "" || e.dataset.step === step)
                                    && (env === "" || e.dataset.env === env)); });
    groups.forEach(g => { g.hidden = !g.querySelector(".ep:not([hidden])"); });
    shown.textContent = eps.filter(e => !e.hidden).length + " of " + eps.length + " shown";
  }
  boxes.concat([stepSel, envSel]).forEach(x => x.addEventListener("change", () => { apply(); writeHash(); }));
  document.getElementById("open").onclick = () => eps.forEach(e => { if (!e.hidden) e.open = true; });
  document.getElementById("close").onclick = () => eps.forEach(e => { e.open = false; });
  window.addEventListener("hashchange", () => { readHash(); apply(); });
  readHash();
  apply();
})();
