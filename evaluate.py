"""Evaluate a model on a benchmark, scored by the tasks' environment (l0_min/envs): QA with the papers' official
EM / F1 (and the SimpleQA judge), math by numeric equality, any environment by its own score().

    python evaluate.py --bench hotpotqa --data ../shared/data/benchmarks/hotpotqa/hotpot_dev_distractor_first103.json \\
        --model smollm2-135m --limit 20
    python evaluate.py --bench gsm8k --data test.jsonl           # the math environment's grader (a GSM8K layout)
    python evaluate.py --bench synthetic:heldout --env files     # an environment's own tasks
    python evaluate.py --bench simpleqa --mode direct --judge-url https://api.openai.com/v1 --judge-model gpt-4.1-mini \\
        --judge-api-key-env OPENAI_API_KEY
    python evaluate.py --bench nq --n-samples 4 sampling.temperature=1.0        # pass@4
    python evaluate.py --table runs/eval                                         # all runs, each environment's tables

Modes: agent (the NB-Agent, through training's rollout path) or direct (one short answer, no tools). Data: --data
(a file, or a folder holding <bench>/<file>), else data.data_dir or $L0_MIN_DATA, else the benchmark's public file
from the Hugging Face hub. Results go to <out>/results.jsonl as each sample ends; rerun the same command after a
kill and it runs only what is missing (README "Evaluate" for search, the judge and the tables).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

from l0_min import config as config_mod
from l0_min.context import ChatFormat
from l0_min.answers import has_answer
from l0_min.data import DataError, Tasks
from l0_min.envs import load_env
from l0_min.episode import ANSWERED, Episode
from l0_min.evaluation import (EvalError, ResultsFile, check_run_info, first_line, format_summary, judge_client,
                               markdown_table, record, summarize)
from l0_min.log import open_jsonl, write_jsonl
from l0_min.models import ModelNotFoundError, resolve_model
from l0_min.rewards import score_episode

DIRECT_SYSTEM = ("Answer the question. Reply with only the answer (a name, date, number or short phrase), "
                 "with no explanation.")
DIRECT_MAX_NEW_TOKENS = 32


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--bench", help="simpleqa, hotpotqa, musique, bamboogle, 2wikimultihopqa, nq, triviaqa, gsm8k; with "
                                    "--data any name (it labels the run); with --env a source the environment reads")
    ap.add_argument("--env", help="the tasks' environment (qa, math, files or a module path); default: math for "
                                  "gsm8k, else qa")
    ap.add_argument("--data", help="the benchmark's file (or a folder holding it); default: data.data_dir, "
                                   "$L0_MIN_DATA, else the Hugging Face hub")
    ap.add_argument("--mode", choices=["agent", "direct"], default="agent")
    ap.add_argument("--model", help="built-in name (smollm2-135m, tiny-random) or a Hugging Face folder; "
                                    "default: model.path of the config")
    ap.add_argument("--n-samples", type=int, default=1, help="samples per question (pass@k with k = this)")
    ap.add_argument("--limit", type=int, help="evaluate only the first N questions of the file")
    ap.add_argument("--concurrency", type=int, help="episodes / requests in flight (rollout.max_concurrency)")
    ap.add_argument("--inference-url", help="SGLang-compatible server(s), comma-separated (inference.urls); "
                                            "default: start the embedded CPU server")
    ap.add_argument("--judge-url", help="the judge: an OpenAI-compatible base URL ending in /v1, an SGLang server, "
                                        "or 'self'; without it the judge columns are left out")
    ap.add_argument("--judge-model", help="the judge model's name (/v1) or tokenizer (SGLang); default: --model")
    ap.add_argument("--judge-api-key-env", metavar="VAR", help="environment variable holding the judge endpoint's "
                                                               "API key (e.g. OPENAI_API_KEY); default: no key")
    ap.add_argument("--out", help="output folder (default: runs/eval/<bench>-<model>-<mode>)")
    ap.add_argument("--config", help="YAML config file (l0_min.config)")
    ap.add_argument("--table", nargs="+", metavar="DIR", help="print the summaries found under these folders "
                                                               "as one table in the paper's layout, and exit")
    ap.add_argument("overrides", nargs="*", help="section.key=value config overrides")
    args = ap.parse_intermixed_args(argv)  # overrides may come before, between or after the flags
    if not args.table and not args.bench:
        ap.error("--bench is required (or --table DIR to print finished runs)")
    if args.n_samples < 1:
        ap.error("--n-samples must be at least 1")
    if args.limit is not None and args.limit < 1:
        ap.error("--limit must be at least 1")
    return args


def label(name: str) -> str:
    """A short name for a model or benchmark: the built-in name or the folder's name."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", Path(name.rstrip("/")).name or name)


def eval_config(args) -> config_mod.Config:
    """Defaults < evaluation defaults (greedy) < --config file < overrides < the command-line flags."""
    base = config_mod.Config()
    base.sampling.temperature = 0.0
    cfg = config_mod.resolve(args.overrides, args.config, base=base)
    if args.model:
        cfg.model.path = args.model
    if args.inference_url:
        cfg.inference.urls = [u for u in args.inference_url.split(",") if u]
    if args.concurrency:
        cfg.rollout.max_concurrency = args.concurrency
    return cfg


def tokenizer_folder(model: str) -> Path:
    """The folder of a model (or a built-in name), which must hold a tokenizer; else an EvalError of one line."""
    path = resolve_model(model)
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")):
        raise EvalError(f"{path} holds no tokenizer (tokenizer.json, tokenizer_config.json ...): copy the tokenizer "
                        "files of the model it was trained from into that folder")  # fmt: skip
    return path


def load_tokenizer(model: str):
    from transformers import AutoTokenizer

    path = tokenizer_folder(model)
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise EvalError(f"{path}: its tokenizer does not load: {type(e).__name__}: {first_line(str(e))}") from None


def check_out(out: Path) -> None:
    """--out must be a folder, or a path where one can be made."""
    for p in (out, *out.parents):
        if p.exists():
            if not p.is_dir():
                raise EvalError(f"--out {out} is a file: name a folder" if p == out else
                                f"--out {out}: {p} is a file, so no folder can be made under it")  # fmt: skip
            return


def judge_settings(args, cfg) -> tuple[str, str]:
    """(the judge's URL, its model), checked before any model loads; an OpenAI-style URL may be written out
    to /chat/completions."""
    url, judge = args.judge_url.rstrip("/").removesuffix("/chat/completions"), args.judge_model or cfg.model.path
    if url.endswith("/v1"):
        if not args.judge_model:
            raise EvalError(f"--judge-url {url} (an OpenAI-compatible endpoint) needs --judge-model, the model name it serves")
        if args.judge_api_key_env and not os.environ.get(args.judge_api_key_env):
            raise EvalError(f"--judge-api-key-env {args.judge_api_key_env}: that environment variable is unset or empty")
    elif not url.startswith(("http://", "https://")) and url != "self":
        raise EvalError(f"--judge-url {args.judge_url}: expected an http(s) URL (ending in /v1 for an OpenAI-compatible "
                        "endpoint) or 'self'")  # fmt: skip
    elif url != "self":
        tokenizer_folder(judge)  # an SGLang judge is prompted with its chat template
    return url, judge


# ---------------------------------------------------------------------------------------------
# the two modes: coroutines that call finish(record, episode_or_None) as each sample ends


def agent_jobs(env, todo, finish) -> list:
    """The NB-Agent through collect.run_tasks, the rollout path of training and rollout.py: one call per
    sample index (a resume may miss different samples of different questions), all running at once
    under the collector's concurrency limit."""
    from l0_min.collect import run_tasks

    def on_episode(sample: int):
        async def save(ep):
            ep.sample = sample
            await finish(record(ep), ep)
        return save

    return [run_tasks(env, [t for t, ts in todo if ts == s], 1, on_episode=on_episode(s)) for s in sorted({s for _, s in todo})]


def direct_jobs(cfg, env, client, tokenizer, todo, finish) -> list:
    chat, s, sem = ChatFormat(tokenizer), cfg.sampling, asyncio.Semaphore(cfg.rollout.max_concurrency)
    sampling = {"max_new_tokens": DIRECT_MAX_NEW_TOKENS, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k}

    async def one(task, sample):
        async with sem:
            t0 = time.monotonic()
            gen = await client.generate(chat.prompt_ids(DIRECT_SYSTEM, task.question), sampling)
            answer = first_line(tokenizer.decode(gen.output_ids, skip_special_tokens=True))
        ep = Episode(task, status=ANSWERED if has_answer(answer) else "no_answer", final_answer=answer, sample=sample,
                     seconds=time.monotonic() - t0)
        score_episode(ep, cfg.reward, env)  # no steps: the environment's answer term alone
        await finish(record(ep) | {"steps": None})

    return [one(t, s) for t, s in todo]


async def run(args, cfg, env, all_tasks, todo, unjudged, save, out: Path) -> None:
    """Generate the missing samples and judge the records this judge has not graded; save(record, episode,
    done) each generation as it ends (the episode with it), then its judged record (done: the sample is
    finished). The first error (a server down, a bad configuration) cancels the rest."""
    from l0_min.runtime import policy_client, rollout_env

    async with contextlib.AsyncExitStack() as stack:
        svc = policy = tokenizer = None
        if todo:
            tokenizer = load_tokenizer(cfg.model.path)
        if todo and args.mode == "agent":
            svc = await stack.enter_async_context(rollout_env(cfg, resolve_model(cfg.model.path), tokenizer, all_tasks,
                                                              {env.name: env}, log_dir=out))
            policy = svc.policy
        elif todo or args.judge_url == "self":
            policy = await stack.enter_async_context(policy_client(cfg, resolve_model(cfg.model.path), out))
        grade = None
        if args.judge_url:
            url, judge = judge_settings(args, cfg)
            tok = load_tokenizer(judge) if not url.endswith("/v1") else None
            grade = await stack.enter_async_context(judge_client(url, judge, args.judge_api_key_env, tok, policy, cfg,
                                                                 env.judge_prompt))
        judging = asyncio.Semaphore(cfg.rollout.max_concurrency)

        async def finish(rec, ep=None, generated=True):
            if generated:  # saved before it is judged: a judge that fails loses no generation
                save(rec, ep, grade is None)
            if grade is not None:
                async with judging:
                    save(rec | await grade(rec), None, True)

        jobs = [finish(r, generated=False) for r in unjudged]
        if todo:
            jobs += agent_jobs(svc, todo, finish) if svc else direct_jobs(cfg, env, policy, tokenizer, todo, finish)
        try:
            async with asyncio.TaskGroup() as tg:
                for job in jobs:
                    tg.create_task(job)
        except ExceptionGroup as eg:
            raise eg.exceptions[0] from None


# ---------------------------------------------------------------------------------------------


def print_table(paths: list[str]) -> None:
    """The summaries found under `paths`: each environment's own tables (QA: the papers' layout), then one row each."""
    found = sorted(p for d in paths for p in ([Path(d)] if Path(d).is_file() else Path(d).rglob("summary.json")))
    if not found:
        raise SystemExit(f"evaluate.py --table: no summary.json under {', '.join(paths)}")
    summaries = [json.loads(p.read_text()) for p in found]
    for name in dict.fromkeys(s.get("env", "qa") for s in summaries):
        if table := load_env(name, config_mod.Config()).report([s for s in summaries if s.get("env", "qa") == name]):
            print(table + "\n")
    print(markdown_table(summaries))


def report_notes(metrics: dict, search: str, cfg, mode: str) -> list[str]:
    """What the summary must say besides the numbers: how the samples ended, what the agent searched, how
    many judge replies named no grade."""
    why = {"timeout": f"the wall-time budget (agent.max_wall_seconds = {cfg.agent.max_wall_seconds:g} s) ran out",
           "max_steps": f"the {cfg.agent.max_steps} steps (agent.max_steps) ran out", "max_tokens": "the context was full",
           "kernel_crashed": "the agent's code killed its kernel", "no_answer": "no answer was generated",
           "env_error": "the sandbox or a tool backend failed after retries (rerun to retry them)",
           "inference_error": "the inference server failed the request"}  # fmt: skip
    status = metrics["status"]
    notes = ["samples by status: " + ", ".join(f"{s} {n}" for s, n in status.items())
             + "".join(f"; {s}: {why[s]}" for s in status if s in why) + " (these score 0)" * (set(status) != {"answered"})]
    if mode == "agent":
        notes.append(f"search: {search}")
    if unparsed := (metrics.get("judge") or {}).get("unparsed_samples"):
        notes.append(f"the judge's reply named no grade for {unparsed} sample(s): counted as 'unparsed', neither correct "
                     "nor not attempted (each reply is quoted in judge_error in results.jsonl)")
    return notes


# ---------------------------------------------------------------------------------------------
# main, step by step


def load_tasks_and_env(args, cfg):
    """The questions (the whole file: its paragraphs make the closed corpus) and their environment (--env, else
    math for gsm8k, else qa), which reads --bench (a name, a file, or a source of its own) from --data (a file, or a
    folder holding <bench>/<file>); the environment's judge if one is asked for."""
    if args.data:
        cfg.data.data_dir = args.data
    try:
        env = load_env(args.env or ("math" if args.bench.strip().lower() == "gsm8k" else "qa"), cfg)
        tasks = env.tasks(args.bench)
    except DataError:
        raise
    except ValueError as e:  # an environment that cannot load, a source it cannot read
        raise EvalError(str(e)) from None
    all_tasks = tasks if isinstance(tasks, Tasks) else Tasks(tasks, source=args.bench)
    for t in all_tasks:
        t.env = env.name
    if args.judge_url and env.judge_prompt("q", ["a"], "a") is None:
        raise EvalError(f"--judge-url: env {env.name!r} has no judge (its judge_prompt() returns None)")
    return args.bench.strip(), all_tasks, env


def search_setting(args, cfg, env, bench: str, all_tasks) -> tuple[str, list[str]]:
    """What the agent may search (sets that carry paragraphs are closed-corpus: BM25 over every question's
    paragraphs, also with --limit), and what the summary must say of it."""
    if args.mode != "agent" or not env.tools:
        return "-", []
    docs = env.corpus(all_tasks)
    if cfg.tools.search == "bm25" and not docs:
        cfg.tools.search = "none"
    if cfg.tools.search == "bm25":
        return (f"bm25 over {cfg.tools.corpus}" if cfg.tools.corpus else
                f"closed corpus: bm25 over the {len(docs)} paragraphs of the file's {len(all_tasks)} questions"), []
    if cfg.tools.search == "none":
        return "none", [f"no search: {bench} carries no paragraphs and no tools.corpus / retriever / web API is "
                        "configured, so the agent answers from its own knowledge"]
    return cfg.tools.search, []


def run_missing(args, cfg, env, all_tasks, keys, todo, unjudged, results, out: Path, t_start: float) -> int:
    """Run what is missing and judge what is not judged, every record appended to results.jsonl as it comes;
    the number of new generations."""
    from tqdm import tqdm

    head = env.eval_metrics[0]
    bar = tqdm(total=len(todo) + len(unjudged), desc=f"{args.bench} {args.mode}", unit="sample", file=sys.stderr,
               dynamic_ncols=True)  # fmt: skip
    traj = out / "trajectories.jsonl"
    trajectories = open_jsonl(traj) if todo and args.mode == "agent" else None
    new, generated = [], []  # finished samples; generations (saved before their verdicts: no "grade")
    wall_before = max((r.get("wall_s", 0.0) for r in results.by_key.values()), default=0.0)

    def save(rec, ep=None, done=True):
        if ep is not None:
            write_jsonl(trajectories, ep.to_json())
        if "grade" not in rec:
            generated.append(rec["id"])
        results.append(rec | {"wall_s": round(wall_before + time.monotonic() - t_start, 3)})  # summed over resumes
        if done:
            new.append(rec)
            bar.set_postfix({head: f"{sum(r.get(head, 0.0) for r in new) / len(new):.3f}"}, refresh=False)
            bar.update(1)

    old_sigterm = signal.signal(signal.SIGTERM, signal.default_int_handler)  # a polite kill stops like Ctrl-C
    try:
        asyncio.run(run(args, cfg, env, all_tasks, todo, unjudged, save, out))
    except KeyboardInterrupt:
        bar.close()
        print(f"\ninterrupted: {len(results.done)} samples are saved in {results.path}; "
              "rerun the same command to finish the rest", file=sys.stderr)
        raise SystemExit(130)
    except Exception as e:
        saved = f"{len(generated)} new samples are saved in {results.path}; rerun the same command to resume"
        if not isinstance(e, (ValueError, OSError, RuntimeError)):  # not a configuration, data or server error
            print(f"\n{saved}", file=sys.stderr)
            raise
        raise EvalError((str(e) or type(e).__name__) + (f" ({saved})" if generated else "")) from e
    finally:
        signal.signal(signal.SIGTERM, old_sigterm)
        bar.close()
        if trajectories is not None:
            trajectories.close()
    return len(generated)


def write_summary(summary: dict, env, out: Path) -> dict:
    """summary.json, summary.md and viewer.html of an evaluation's summary record (model, mode, bench, env, data,
    metrics, search, judge_model, wall_s, resumed_samples, notes), made from the file: the same numbers whether or not
    the run was interrupted; printed too."""
    write = functools.partial(Path.write_text, encoding="utf-8", errors="backslashreplace")  # any str: JSON \\u escapes
    write(out / "summary.json", json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    per_source = [summary | {"bench": f"{summary['bench']}: {src}", "metrics": m, "wall_s": None}
                  for src, m in summary["metrics"].get("sources", {}).items()]
    table = markdown_table([summary] + per_source)
    if per_source and (own := env.report([summary])):
        table += f"\n\nper source:\n\n{own}"
    write(out / "summary.md", table + "\n" + "".join(f"\n- {n}" for n in summary["notes"]) + "\n")
    if summary["mode"] == "agent" and (out / "trajectories.jsonl").exists():
        try:
            from l0_min.viewer import write_viewer

            write_viewer(out / "trajectories.jsonl", out / "viewer.html",
                         title=f"{summary['bench']} {summary['mode']} {summary['model']}")
        except Exception as e:  # the viewer is a convenience; the results are already safe
            print(f"viewer.html not written: {type(e).__name__}: {e}", file=sys.stderr)
    print(table, format_summary(summary["metrics"]), *(f"- {n}" for n in summary["notes"]), sep="\n")
    print(f"results: {out / 'results.jsonl'}; summary: {out / 'summary.json'}")
    return summary


def main(argv=None) -> dict | None:
    t_start = time.monotonic()
    args = parse_args(argv)
    if args.table:
        print_table(args.table)
        return None
    cfg = eval_config(args)
    if args.out:
        check_out(Path(args.out))
    if args.judge_url:
        judge_settings(args, cfg)  # before the data, the model or the servers load

    # 1. the questions and their environment; --limit picks the first N
    bench, all_tasks, env = load_tasks_and_env(args, cfg)
    tasks, k = (all_tasks[: args.limit] if args.limit else list(all_tasks)), args.n_samples

    # 2. what the agent may search, and what the summary must say
    search, notes = search_setting(args, cfg, env, bench, all_tasks)
    notes.insert(0, f"scores: env {env.name}'s score(): {', '.join(env.eval_metrics)}")
    if k > 1 and cfg.sampling.temperature == 0:
        notes.append(f"{k} samples per question at temperature 0 (greedy) are alike; set sampling.temperature for pass@k")
    if not args.judge_url and env.judge_prompt("q", ["a"], "a") is not None:
        notes.append("judge off (no --judge-url)" + ("; the SimpleQA tables report the judge's accuracy"
                                                      if bench == "simpleqa" else ""))

    # 3. the evaluation folder: run.json must match to resume; results.jsonl says what is done (and judged)
    out = Path(args.out or Path("runs") / "eval" / f"{label(bench)}-{label(cfg.model.path)}-{args.mode}")
    src = Path(all_tasks.source)
    info = {"bench": bench, "env": env.name, "data": str(src.resolve()) if src.exists() else all_tasks.source,
            "mode": args.mode, "model": cfg.model.path, "search": search, "scoring": list(env.eval_metrics),
            "sampling": dataclasses.asdict(cfg.sampling) | ({"max_new_tokens": DIRECT_MAX_NEW_TOKENS} if args.mode == "direct" else {}),
            "agent": dataclasses.asdict(cfg.agent) if args.mode == "agent" else None}  # fmt: skip
    check_run_info(out / "run.json", info)
    config_mod.save(cfg, out / "config.yaml")
    judge = (args.judge_model or cfg.model.path) if args.judge_url else None
    with ResultsFile(out / "results.jsonl") as results:
        keys = [(t.id, s) for t in tasks for s in range(k)]
        todo = [(t, s) for t in tasks for s in range(k) if (t.id, s) not in results.done]
        unjudged = [results.by_key[key] for key in keys if judge and key in results.done and results.by_key[key].get("judge") != judge]
        print(f"{bench}: {len(tasks)} of {len(all_tasks)} questions x {k} sample(s), {args.mode} mode, env {env.name}, "
              f"model {cfg.model.path}; {len(keys) - len(todo)} done before, {len(todo)} to run, {len(unjudged)} to "
              f"judge -> {out}", file=sys.stderr)

        # 4. run what is missing, judge what is not judged; every record is appended to results.jsonl at once
        if todo or unjudged:
            run_missing(args, cfg, env, all_tasks, keys, todo, unjudged, results, out, t_start)
        records = [results.by_key[key] for key in keys if key in results.by_key]
        wall = max((r.get("wall_s", 0.0) for r in results.by_key.values()), default=0.0)

    # 5. the summary, from the file
    metrics = summarize(records, env.eval_metrics, k, judged=bool(judge))
    return write_summary({"model": label(cfg.model.path), "mode": args.mode, "bench": bench, "env": env.name,
                          "data": info["data"], "metrics": metrics, "search": search, "judge_model": judge, "wall_s": wall,
                          "resumed_samples": len(keys) - len(todo),
                          "notes": notes + report_notes(metrics, search, cfg, args.mode)}, env, out)


if __name__ == "__main__":
    try:
        main()
    except (EvalError, config_mod.ConfigError, DataError, ModelNotFoundError) as e:
        raise SystemExit(f"evaluate.py: {e}")
