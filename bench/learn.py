"""Proof that the learner learns: FSDP2 + REINFORCE++ on a random tiny LM in a multi-step env.

    torchrun --nproc_per_node=2 bench/learn.py          # full: up to 5 minutes
    torchrun --nproc_per_node=2 bench/learn.py --quick  # the same, fewer steps (tests run this)

The policy is a randomly initialised 2-layer Llama with a 16-word tokenizer (bench/toy.py). The
environment (EchoEnv) shows 3 symbols one at a time and rewards echoing each; a random policy
scores 1/16. Every piece is the one train.py uses: Episode records with sampled ids and log-probs,
`training_rows` (REINFORCE++ step returns, batch-step-wise normalisation), the FSDP2 `Learner`
(DAPO token-level loss), and weight sync to a separate sampler model after every step.
"""

import argparse
import collections
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from l0_min.config import Config  # noqa: E402
from l0_min.episode import training_rows  # noqa: E402
from l0_min.distributed import close_distributed, init_distributed  # noqa: E402
from l0_min.learner import Learner, shard_rows  # noqa: E402
from bench.toy import EchoEnv, make_toy_model  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--quick", action="store_true")
ap.add_argument("--advantage", default="reinforce++")
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--overlap", type=int, default=0, help="the sampler lags this many updates behind the learner "
                "(as with rollout.overlap); the learner's truncated importance weights correct for it")
args = ap.parse_args()

TARGET, TIME_LIMIT = 0.8, 300.0
max_steps = 40 if args.quick else 150
n_groups, group_size = 32, 4

torch.set_num_threads(1)
rank, world, device = init_distributed()
cache = Path(os.environ.get("L0_MIN_CACHE", Path.home() / ".cache" / "l0_min"))
folder = cache / f"toy-echo-seed{args.seed}"
if rank == 0:
    make_toy_model(folder, seed=args.seed)
dist.barrier()

cfg = Config()
cfg.learner.lr, cfg.learner.micro_batch_tokens, cfg.learner.grad_clip = 3e-3, 4096, 1.0
cfg.algo.advantage = args.advantage
learner = Learner(folder, cfg.learner, cfg.algo, total_steps=max_steps)
env = EchoEnv(n_steps=3)
gen = torch.Generator().manual_seed(args.seed)
sampler = None
if rank == 0:
    from transformers import AutoModelForCausalLM

    sampler = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)

t0 = time.perf_counter()
history, states = [], collections.deque(maxlen=args.overlap + 1)
if rank == 0:
    print(f"{'step':>4} {'reward':>7} {'loss':>8} {'grad':>6} {'tok/s':>7} {'sec':>6}", flush=True)
for step in range(1, max_steps + 1):
    payload = [None]
    if rank == 0:
        episodes = env.rollout(sampler, n_groups, group_size, gen)
        reward = sum(e.reward for e in episodes) / len(episodes)
        payload = [(training_rows(episodes, cfg.algo), reward)]
    dist.broadcast_object_list(payload, src=0)
    rows, reward = payload[0]
    stats = learner.train_step(shard_rows(rows, rank, world))
    states.append(learner.full_state_dict())  # weight sync: the sampler gets the policy of `overlap` steps ago
    if rank == 0:
        sampler.load_state_dict(states[0])
        history.append(reward)
        print(f"{step:>4} {reward:7.3f} {stats['loss']:8.4f} {stats['grad_norm']:6.2f} {stats['tokens_per_s']:7.0f} {time.perf_counter() - t0:6.1f}", flush=True)
    done = torch.tensor([int(rank == 0 and len(history) >= 3 and sum(history[-3:]) / 3 >= TARGET + 0.05)])
    dist.broadcast(done, src=0)
    if done.item() or time.perf_counter() - t0 > TIME_LIMIT:
        break

if rank == 0:
    elapsed = time.perf_counter() - t0
    final = env.rollout(sampler, 128, 4, torch.Generator().manual_seed(12345))  # held-out evaluation
    final_reward = sum(e.reward for e in final) / len(final)
    start = history[0]
    print(f"\nranks={world} steps={len(history)} overlap={args.overlap} first-batch reward={start:.3f} (random level 0.0625)")
    print(f"final reward on 512 fresh episodes={final_reward:.3f} in {elapsed:.0f} s")
    print(f"RESULT final_reward={final_reward:.3f} target >= {TARGET} {'MET' if final_reward >= TARGET else 'SHORT'}")
    print(f"RESULT seconds={elapsed:.0f} target <= {TIME_LIMIT:.0f} {'MET' if elapsed <= TIME_LIMIT else 'SHORT'}")
close_distributed()  # the other ranks wait for rank 0's evaluation
