"""Run the NB-Agent over a dataset without training: collect trajectories, debug a scaffold.

    python rollout.py --data synthetic:heldout --limit 20 --model smollm2-135m
    python rollout.py --data synthetic:heldout --data hotpotqa --limit 20   # 20 of each, one corpus
    python rollout.py env=math --data synthetic:heldout --limit 20 --expert  # another environment (l0_min/envs)
    python rollout.py --data hotpotqa --inference-url http://gpu-host:30000 rollout.max_concurrency=256

Writes OUT/trajectories.jsonl (one Episode per line, as each finishes), OUT/summary.json and
OUT/viewer.html, and shows a live progress line: episodes done/total, mean reward, agent steps/s,
failures. Without --inference-url the embedded CPU server is started on --model.
"""

import argparse
import asyncio
import dataclasses
import json
import time
from pathlib import Path

from l0_min import config as configlib
from l0_min.collect import ExpertPolicy, InferenceDown, run_tasks
from l0_min.envs import load_sources
from l0_min.episode import ENV_ERROR, INFERENCE_ERROR, TIMEOUT, Episode
from l0_min.evaluation import format_summary, summarize_episodes
from l0_min.log import batch_metrics, fail, write_jsonl
from l0_min.models import resolve_model
from l0_min.runtime import rollout_env, settle_gc
from l0_min.viewer import write_viewer

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--config", help="a YAML file of overrides (see configs/)")
ap.add_argument("--data", action="append", default=[],
                help="a source of the run's environment (env=...): synthetic[:train|:heldout], a benchmark name or a "
                     "file (default: data.eval); repeatable: the tasks are joined and search runs over the union of "
                     "their paragraphs")
ap.add_argument("--limit", type=int, default=None, help="first N tasks of each --data")
ap.add_argument("--n-samples", type=int, default=1, help="episodes per task")
ap.add_argument("--model", help="model for the embedded server (default: model.path)")
ap.add_argument("--inference-url", action="append", default=[], help="SGLang server URL (repeatable)")
ap.add_argument("--expert", action="store_true", help="the environment's scripted expert writes the actions "
                "(collect.ExpertPolicy, through the same kernels and tools): SFT episodes, or a ceiling to compare with")
ap.add_argument("--out", help="output folder (default runs/rollout-<time>)")
ap.add_argument("overrides", nargs="*", help="section.key=value")
args = ap.parse_args()


try:
    cfg = configlib.resolve(args.overrides, args.config)
except configlib.ConfigError as e:
    fail(str(e))
if args.model:
    cfg.model.path = args.model
if args.inference_url:
    cfg.inference.urls = args.inference_url
out = Path(args.out or f"runs/rollout-{time.strftime('%Y%m%d-%H%M%S')}")
out.mkdir(parents=True, exist_ok=True)
configlib.save(cfg, out / "config.yaml")

try:
    parts, _, envs = load_sources([configlib.Source(d) for d in args.data] or cfg.data.eval, cfg, limit=args.limit)
    tasks = [t for ts in parts for t in ts]
    model_path = resolve_model(cfg.model.path)
    if args.expert and (none := [t.id for t in tasks if envs[t.env].expert(t) is None]):
        fail(f"--expert: the environment has no expert for {len(none)} tasks, e.g. {none[0]!r}")
except Exception as e:
    fail(str(e))

from transformers import AutoTokenizer  # noqa: E402  (slow import, after the argument checks)

tokenizer = AutoTokenizer.from_pretrained(model_path)


class Progress:
    """One self-overwriting status line."""

    def __init__(self, total: int):
        self.total, self.done, self.reward, self.steps, self.failures = total, 0, 0.0, 0, 0
        self.t0 = time.perf_counter()
        self.file = open(out / "trajectories.jsonl", "w", encoding="utf-8")

    def __call__(self, ep: Episode) -> None:
        write_jsonl(self.file, ep.to_json())
        self.done += 1
        self.reward += ep.reward
        self.steps += len(ep.steps)
        self.failures += ep.status in (ENV_ERROR, INFERENCE_ERROR, TIMEOUT)
        secs = time.perf_counter() - self.t0
        print(f"\r{self.done}/{self.total} episodes  reward {self.reward / self.done:.3f}  "
              f"{self.steps / secs:.2f} steps/s  failures {self.failures}  {secs:.0f} s", end="", flush=True)


async def main() -> list[Episode]:
    progress = Progress(len(tasks) * args.n_samples)
    async with rollout_env(cfg, model_path, tokenizer, tasks, envs, log_dir=out) as svc:
        settle_gc()
        if args.expert:
            svc = dataclasses.replace(svc, policy=ExpertPolicy(tasks, envs, tokenizer, cfg.agent.prefill))
        episodes = await run_tasks(svc, tasks, args.n_samples, on_episode=progress)
    print()
    return episodes


t0 = time.perf_counter()
try:
    episodes = asyncio.run(main())
except (InferenceDown, ValueError) as e:  # the servers gone; a setting that cannot work (a search without documents)
    fail(str(e))
scores = summarize_episodes(episodes, envs)  # per environment (and "all"), as train.py's held-out evaluation
summary = batch_metrics(episodes, envs) | {"scores": scores, "seconds": time.perf_counter() - t0,
                                           "data": " + ".join(f"{s.env or cfg.env}:{s.source}" for s in
                                                              ([configlib.Source(d) for d in args.data] or cfg.data.eval))}
(out / "summary.json").write_text(json.dumps(summary, indent=1))
write_viewer(out / "trajectories.jsonl", out / "viewer.html")
print(f"{len(episodes)} episodes in {summary['seconds']:.0f} s: " + "; ".join(
    f"{name}: {format_summary(m)}" for name, m in scores.items()))
print(f"wrote {out}/trajectories.jsonl, summary.json, viewer.html")
