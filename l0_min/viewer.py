"""A static, single-file HTML viewer of agent trajectories.

    python -m l0_min.viewer runs/my_run            # writes runs/my_run/viewer.html
    python -m l0_min.viewer a.jsonl b.jsonl --out view.html

For a run folder the page grows: a call renders only the trajectories files new since the last one (`viewer.json`
records them), so train.py's call after every step costs that step's episodes; a changed file rebuilds the page. All
trajectory text is HTML-escaped here and the page's script only toggles `hidden` and `open`: nothing an agent printed
is parsed as markup or run; no network resources. Filters live in the URL hash (`#status=answered&open=all`).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import re
from html import escape
from pathlib import Path

from l0_min.config import is_number
from l0_min.episode import STATUSES


def _e(x) -> str:
    return escape("" if x is None else str(x), quote=True)


def _num(x, fmt: str = ".3g") -> str:
    return format(x, fmt) if is_number(x) else "-"


def _mean(xs: list) -> str:
    xs = [x for x in xs if isinstance(x, (int, float))]
    return _num(sum(xs) / len(xs) if xs else None, ".3f")


def _natural_key(p: Path):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.stem)]


def _jsonl_files(src) -> list[Path]:
    files: list[Path] = []
    for s in map(Path, [src] if isinstance(src, (str, Path)) else src):
        if s.is_dir():
            folder = s / "trajectories" if (s / "trajectories").is_dir() else s
            files += sorted(folder.glob("*.jsonl"), key=_natural_key)
        elif s.is_file():
            files.append(s)
        else:
            raise FileNotFoundError(f"viewer: no such run folder or trajectories file: {s}")
    return files


# ------------------------------------------------------------------------------------ rendering
def _pre(label: str, text: str, cls: str) -> str:
    return f'<div class="blk {cls}"><div class="lbl">{label}</div><pre>{_e(text)}</pre></div>' if text else ""


def _step_html(i: int, s: dict) -> str:
    fmt = {True: "ok", False: "bad"}.get(s.get("format_ok"), "")
    exe = {True: "ok", False: "bad"}.get(s.get("exec_ok"), "na")
    head = (f'<span class="sn">step {i + 1}</span>'
            f'<span class="flag {fmt}">format {"✓" if fmt == "ok" else "✗"}</span>'
            f'<span class="flag {exe}">exec {dict(ok="✓", bad="✗", na="–")[exe]}</span>'
            f'<span>reward {_num(s.get("reward"))}</span>'
            f'<span>{len(s.get("action_ids") or [])} tokens</span>'
            f'<span>{_num(s.get("seconds"), ".1f")} s</span>'
            + "".join(f"<span>{name} {_e(s[key])}</span>" for name, key in (("finish", "finish_reason"),
                      ("segment", "segment"), ("weights", "weight_version")) if s.get(key)))
    body = _pre("think", s.get("think", ""), "think") + _pre("code", s.get("code", ""), "code")
    if (not s.get("think") and not s.get("code") or s.get("format_ok") is False) and s.get("action_text"):
        body += f'<details class="raw"><summary>raw action text</summary><pre>{_e(s["action_text"])}</pre></details>'
    # the observation without its <output> wrapper, for display only
    m = re.fullmatch(r"\s*<output>\n?(.*?)\n?</output>\s*", s.get("observation") or "", flags=re.DOTALL)
    out = m.group(1) if m else (s.get("observation") or "")
    none = '<div class="blk out"><div class="lbl">output</div><span class="dim">(none)</span></div>'
    body += _pre("output", out, "out") or none
    return f'<div class="step"><div class="shead">{head}</div>{body}</div>'


def _episode_html(ep: dict, group: str) -> str:
    task, rewards, steps = ep.get("task") or {}, ep.get("rewards") or {}, ep.get("steps") or []
    status, final, env = str(ep.get("status", "")), ep.get("final_answer"), str(task.get("env", "qa"))
    head = next((k for k in ("em", "correct") if k in rewards), None)  # the headline of QA, of math and files
    em_mark = ('<span class="em"></span>' if head is None else f'<span class="em {"ok" if rewards[head] else "bad"}">'
               f'{"EM" if head == "em" else ""} {"✓" if rewards[head] else "✗"}</span>')
    summary = (f'<span class="badge s-{_e(status)}">{_e(status)}</span>'
               f'<span class="rw">{_num(ep.get("reward"), ".2f")}</span>{em_mark}'
               f'<span class="tid">{_e(env)} · {_e(task.get("id"))} · g{_e(ep.get("group"))} s{_e(ep.get("sample"))}</span>'
               f'<span class="q">{_e(task.get("question"))}</span>'
               f'<span class="fa">→ {_e(final) if final is not None else "<i>no answer</i>"}</span>'
               f'<span class="ns">{len(steps)} step{"" if len(steps) == 1 else "s"}</span>'
               + ('<span class="badge masked">masked</span>' if ep.get("masked") else ""))
    chips = f'<span class="chip total">reward {_num(ep.get("reward"))}</span>' + "".join(
        f'<span class="chip">{_e(k)} {_num(v) if is_number(v) else _e(v)}</span>' for k, v in rewards.items())
    tools = ", ".join(f"{_e(k)}×{_e(v)}" for k, v in (ep.get("tool_calls") or {}).items()) or "none"
    facts = [("question", f'<span class="qfull">{_e(task.get("question"))}</span>'),
             ("gold", " | ".join(f"<b>{_e(a)}</b>" for a in task.get("answers") or []) or "-"),
             ("final answer", f"<b>{_e(final)}</b>" if final is not None else "<i>none</i>"),
             ("rewards", chips),
             ("run", f'{_num(ep.get("seconds"), ".1f")} s · {sum(len(s.get("action_ids") or []) for s in steps)} '
                     f'action tokens · {_e(ep.get("truncations", 0))} truncations · tools: {tools}'
                     + (f' · weights {_e(ep.get("weight_version"))}' if ep.get("weight_version") else ""))]
    if ep.get("error"):
        facts.append(("error", f'<pre class="err">{_e(ep["error"])}</pre>'))
    if task.get("meta"):
        facts.append(("meta", f"<code>{_e(json.dumps(task['meta'], ensure_ascii=False))}</code>"))
    rows = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in facts)
    steps_html = "".join(_step_html(i, s) for i, s in enumerate(steps)) or '<p class="dim">no steps</p>'
    return (f'<details class="ep" data-status="{_e(status)}" data-step="{_e(group)}" data-env="{_e(env)}">'
            f"<summary>{summary}</summary><table class=facts>{rows}</table>{steps_html}</details>")


PHASES = {"sft": "SFT: expert episodes", "step": "RL", "eval": "held-out, sampled", "eval-greedy": "held-out, greedy"}


def _phase(name: str) -> str:
    """The phase of a trajectories file by its prefix (sft_00000, step_00003, eval-greedy_00008, ...)."""
    return PHASES.get(name.rsplit("_", 1)[0], "other")


def _head(path: Path, limit: int | None) -> tuple[list[dict], int]:
    """The first `limit` records of a trajectories file (None: all), and how many it holds (the others are
    counted, not parsed). A last line cut short by a kill is left out, as log.read_jsonl does."""
    lines = [x for x in Path(path).read_text(encoding="utf-8", errors="replace").split("\n")[:-1] if x.strip()]
    try:
        return [json.loads(x) for x in lines[:limit]], len(lines)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON: {e}") from None


def _group_html(name: str, eps: list[dict], total: int) -> str:
    train = [e for e in eps if not e.get("masked")]  # the means are over the episodes that train
    head = (f"<h2>{_e(name)} <small>{_e(_phase(name))}</small></h2><span>{total} episodes" + (f" (first {len(eps)} shown)" if len(eps) < total else "")
            + f" · reward {_mean([e.get('reward') for e in train])}"
            + f" · EM {_mean([(e.get('rewards') or {}).get('em') for e in train])}"
            + f" · answered {sum(e.get('status') == 'answered' for e in eps)}/{len(eps)}</span>")
    body = "".join(_episode_html(ep, name) for ep in eps)
    return (f'<section class="group" data-step="{_e(name)}" data-phase="{_e(_phase(name))}" data-total="{total}">'
            f'<div class="ghead">{head}</div>{body}</section>')


def write_viewer(src, out_html: str | Path, max_episodes_per_step: int | None = None, title: str | None = None) -> Path:
    """Write a self-contained HTML viewer of the episodes in `src` (a run folder, a folder of .jsonl files, one
    file, or a list of them) to `out_html`, the first `max_episodes_per_step` of each file (None or 0: all)."""
    files, out_html, limit = _jsonl_files(src), Path(out_html), max_episodes_per_step or None
    folder = Path(src) if isinstance(src, (str, Path)) and Path(src).is_dir() else None  # its page grows
    title = title or (Path(src).name if isinstance(src, (str, Path)) else f"{len(files)} files")
    stamps = {f.name: [(st := f.stat()).st_size, st.st_mtime_ns] for f in files}
    state_file, key = out_html.with_suffix(".json"), {"title": title, "max_per_step": limit}
    done = _appendable(out_html, state_file, key, stamps) if folder else None
    groups = "".join(_group_html(f.stem, *_head(f, limit)) for f in files if done is None or f.name not in done)
    out_html.parent.mkdir(parents=True, exist_ok=True)
    with open(out_html, "wb" if done is None else "r+b") as page:
        if done is None:
            png = folder / "plots" / "rewards.png" if folder else None  # linked: the plot changes every step
            plot = (f'<p class="dim"><a href="{_e(os.path.relpath(png, out_html.parent))}">reward curves</a></p>'
                    if png and png.is_file() else "")
            page.write(_PAGE.format(title=_e(title), plot=plot, css=_CSS, script_hash=_SCRIPT_HASH).encode())
        else:
            page.seek(-len(_END_BYTES), 2)
            page.truncate()
        page.write((groups + _END).encode("utf-8", errors="replace"))  # lone surrogates from bad UTF-8 -> '?'
    if folder:
        state_file.write_text(json.dumps({"key": key, "files": stamps}))
    return out_html


def _appendable(out_html: Path, state_file: Path, key: dict, stamps: dict) -> set | None:
    """The files the page shows, if new ones can be appended: it ends as this module writes pages, with the
    same title and limit, and none of its files changed since. Else None (build it anew)."""
    try:
        state = json.loads(state_file.read_text())
        with open(out_html, "rb") as page:
            page.seek(-len(_END_BYTES), 2)
            same = page.read() == _END_BYTES and state["key"] == key
        return set(state["files"]) if same and all(stamps.get(n) == v for n, v in state["files"].items()) else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


# The page: its head and filter bar (filled by the script), then one <section> per trajectories file, then _END.
_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; script-src '{script_hash}'">
<title>{title} · trajectories</title><style>{css}</style></head>
<body>
<header><h1>{title} <small id="counts"></small></h1>
<div class="bar"><span class="lbl2">status</span><span id="boxes"></span>
<span class="lbl2">step</span><select id="step"><option value="">all steps</option></select>
<span class="lbl2 envs">environment</span><select id="env" class="envs"><option value="">all</option></select>
<button id="open">expand all</button><button id="close">collapse all</button>
<span id="shown" class="dim"></span></div></header>
<main>{plot}"""

_CSS = """
:root { --bg:#f6f7f9; --card:#fff; --line:#dde1e6; --dim:#6b7280; --ok:#15803d; --bad:#b91c1c; }
* { box-sizing: border-box; } [hidden] { display: none !important; }
body { margin:0; background:var(--bg); color:#111827; font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif; }
header { position:sticky; top:0; z-index:2; background:#fff; border-bottom:1px solid var(--line); padding:8px 16px; }
h1 { font-size:17px; margin:0 0 6px; } h1 small { color:var(--dim); font-weight:normal; font-size:13px; }
.bar { display:flex; flex-wrap:wrap; gap:6px; align-items:center; }
.bar label { cursor:pointer; } .bar input { margin:0 2px 0 0; vertical-align:-2px; }
.lbl2 { color:var(--dim); font-size:12px; text-transform:uppercase; letter-spacing:.04em; margin-left:6px; }
button, select { font:inherit; font-size:13px; padding:2px 8px; border:1px solid var(--line); border-radius:4px; background:#fff; }
main { padding:10px 16px 40px; max-width:1400px; }
.ghead { display:flex; gap:12px; align-items:baseline; margin:14px 0 6px; }
.ghead h2 { font-size:15px; margin:0; font-family:ui-monospace,monospace; } .ghead span { color:var(--dim); }
.ep { background:var(--card); border:1px solid var(--line); border-radius:6px; margin:4px 0; }
.ep[open] { border-color:#9ca3af; box-shadow:0 1px 4px rgba(0,0,0,.06); }
.ep > summary { display:flex; gap:10px; align-items:center; padding:5px 10px; cursor:pointer; white-space:nowrap; }
.ep > summary::-webkit-details-marker { display:none; }
.ep > summary::before { content:"▸"; color:var(--dim); } .ep[open] > summary::before { content:"▾"; }
.badge { display:inline-block; padding:1px 7px; border-radius:10px; font-size:12px; background:#e5e7eb; }
.s-answered { background:#dcfce7; color:#14532d; } .s-max_steps, .s-max_tokens { background:#fef3c7; color:#78350f; }
.s-timeout { background:#ffedd5; color:#7c2d12; } .s-env_error, .s-inference_error { background:#fee2e2; color:#7f1d1d; }
.masked { background:#e0e7ff; color:#312e81; }
.ep > summary > .badge:first-child { min-width:8.6em; text-align:center; }
.rw { font-family:ui-monospace,monospace; font-weight:600; min-width:3.2em; text-align:right; }
.em { font-size:12px; font-weight:600; min-width:3em; } .ok { color:var(--ok); } .bad { color:var(--bad); } .na { color:var(--dim); }
.tid { color:var(--dim); font-family:ui-monospace,monospace; font-size:12px; }
.q { overflow:hidden; text-overflow:ellipsis; flex:1; min-width:8em; }
.fa { max-width:22em; overflow:hidden; text-overflow:ellipsis; } .ns { color:var(--dim); font-size:12px; }
table.facts { border-collapse:collapse; margin:4px 12px 8px; } .facts td { padding:2px 0; }
.facts th { text-align:left; color:var(--dim); font-weight:normal; padding:2px 12px 2px 0; vertical-align:top; white-space:nowrap; }
.chip { display:inline-block; background:#f3f4f6; border-radius:4px; padding:0 6px; margin:0 4px 2px 0; font-family:ui-monospace,monospace; font-size:12px; }
.chip.total { background:#e0f2fe; font-weight:600; } .step { border-top:1px solid var(--line); padding:6px 12px 8px; }
.shead { display:flex; flex-wrap:wrap; gap:12px; font-size:12px; color:var(--dim); margin-bottom:4px; }
.shead .sn { color:#111827; font-weight:600; } .flag.ok { color:var(--ok); } .flag.bad { color:var(--bad); }
.qfull { white-space:pre-wrap; } .blk { display:grid; grid-template-columns:4.5em 1fr; gap:6px; margin:3px 0; }
.blk .lbl { color:var(--dim); font-size:12px; text-align:right; padding-top:4px; }
pre { margin:0; padding:5px 8px; border-radius:4px; white-space:pre-wrap; word-break:break-word; max-height:26em; overflow:auto;
      font:12.5px/1.4 ui-monospace,"DejaVu Sans Mono",Menlo,monospace; }
.think pre { background:#f9fafb; color:#374151; font-family:inherit; font-size:13px; font-style:italic; }
.code pre { background:#1f2937; color:#e5e7eb; } .out pre { background:#fffbeb; border:1px solid #fde68a; }
.raw { margin:3px 0 3px 5em; font-size:12px; color:var(--dim); } .raw pre { background:#f3f4f6; color:#111827; }
pre.err { background:#fef2f2; color:var(--bad); }
.dim { color:var(--dim); }
"""

_JS = """
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
    if (p.has("status")) boxes.forEach(b => { b.checked = p.get("status").split(",").includes(b.value); });
    if (Array.from(stepSel.options).some(o => o.value === p.get("step"))) stepSel.value = p.get("step");
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
""".replace("STATUSES", json.dumps(list(STATUSES))).replace("PHASES", json.dumps(list(PHASES.values())))

# Defence in depth: the page's Content-Security-Policy lets only this exact script run, so even a
# bug in escaping could not execute a script (or an onerror= handler) an agent printed.
_SCRIPT_HASH = "sha256-" + base64.b64encode(hashlib.sha256(_JS.encode()).digest()).decode()
_END = f"</main>\n<script>{_JS}</script>\n</body></html>\n"  # a page ends so; new files are written over it
_END_BYTES = _END.encode()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m l0_min.viewer", description=__doc__.split("\n\n")[0])
    ap.add_argument("src", nargs="+", help="a run folder, or trajectories .jsonl files")
    ap.add_argument("--out", help="output HTML (default: RUN_DIR/viewer.html for one run folder)")
    ap.add_argument("--max-per-step", type=int, default=None, help="keep the first N episodes of each step")
    args = ap.parse_args(argv)
    if args.out is None:
        if len(args.src) != 1 or not Path(args.src[0]).is_dir():
            ap.error("--out is required unless the source is one run folder")
        args.out = str(Path(args.src[0]) / "viewer.html")
    try:
        src = args.src[0] if len(args.src) == 1 else args.src
        out = write_viewer(src, args.out, max_episodes_per_step=args.max_per_step)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"viewer: {e}") from None
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
