"""Run under torchrun by tests/test_learner.py. Writes a JSON report to argv[1].

Checks, on one global batch split over the ranks:
  1. the FSDP2 step equals a single-process plain-PyTorch step (loss and updated weights);
  2. the exported Hugging Face folder reloads bit-exactly, and a bf16 export holds bf16 tensors;
  3. a checkpoint written after step 1 and loaded back reproduces step 2's loss and weights.
"""

import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from l0_min.config import Config  # noqa: E402
from l0_min.episode import Row  # noqa: E402
from l0_min.distributed import close_distributed, init_distributed  # noqa: E402
from l0_min.learner import Learner, shard_rows, token_logprobs  # noqa: E402
from bench.toy import make_toy_model  # noqa: E402

out, tmp = Path(sys.argv[1]), Path(sys.argv[2])
torch.set_num_threads(1)
rank, world, _ = init_distributed()
folder = tmp / "toy"
if rank == 0:
    make_toy_model(folder, seed=1)
dist.barrier()


def own_logps(weights: dict | None, ids: list[int]) -> list[float]:
    """The sampler's log-probs of `ids` when the sampler holds the learner's weights (position 0: 0)."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if weights is not None:
        m.load_state_dict(weights)
    with torch.no_grad():
        t = torch.tensor(ids)[None]
        lp = torch.log_softmax(m(t).logits[0, :-1].float(), -1).gather(-1, t[0, 1:, None]).squeeze(-1)
    return [0.0] + lp.tolist()


def batch(seed: int, weights: dict | None = None) -> list[Row]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(7):  # uneven lengths, uneven split over ranks
        n = 5 + int(torch.randint(12, (1,), generator=g))
        ids = torch.randint(16, (n,), generator=g).tolist()
        mask = [0.0, 0.0] + [float(torch.rand(1, generator=g) < 0.6) for _ in range(n - 2)]
        adv = [m * float(torch.randn(1, generator=g)) for m in mask]
        rows.append(Row(ids, mask, adv, own_logps(weights, ids)))
    return rows


cfg = Config()
cfg.learner.lr, cfg.learner.micro_batch_tokens, cfg.learner.grad_clip = 1e-2, 24, 0.5
learner = Learner(folder, cfg.learner, cfg.algo, total_steps=3)
report = {}

# 1. FSDP step vs a plain single-process step on the same global batch
rows = batch(0)
stats = learner.train_step(shard_rows(rows, rank, world))
state = learner.full_state_dict()
if rank == 0:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0)
    n = sum(1 for r in rows for m in r.mask if m > 0)
    loss = 0.0
    for r in rows:  # one row at a time, no packing, no FSDP
        ids = torch.tensor(r.ids)[None]
        logp = torch.log_softmax(ref(ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        l_row = -(logp * torch.tensor(r.mask[1:]) * torch.tensor(r.adv[1:])).sum() / n
        l_row.backward()
        loss += l_row.item()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    opt.step()
    ref_sd = ref.state_dict()
    report["loss_fsdp"], report["loss_ref"] = stats["loss"], loss
    report["max_weight_diff"] = max((state[k] - ref_sd[k]).abs().max().item() for k in state)
    report["max_weight_change"] = max((ref_sd[k] - v).abs().max().item() for k, v in AutoModelForCausalLM.from_pretrained(folder).state_dict().items())

# 2. export -> reload bit-exactly
export = tmp / "export"
learner.export_hf(export)
if rank == 0:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    back = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).state_dict()
    report["export_bit_exact"] = all(torch.equal(back[k], state[k]) for k in state)
    report["export_files"] = sorted(p.name for p in export.iterdir())
    report["export_tokenizer_ok"] = AutoTokenizer.from_pretrained(export)("go a").input_ids == [3, 4]
bf16 = learner.export_hf(tmp / "export_bf16", dtype="bfloat16")
if rank == 0:
    from l0_min.models import load_safetensors_folder

    back = load_safetensors_folder(bf16)
    report["bf16_absolute"] = bf16.is_absolute()
    report["bf16_dtypes"] = sorted({str(t.dtype) for t in back.values()})
    report["bf16_config_dtype"] = json.loads((bf16 / "config.json").read_text()).get("dtype")
    report["bf16_equal"] = all(torch.equal(back[k], state[k].to(torch.bfloat16)) for k in state)

# 3. checkpoint after step 1, step 2, then load and redo step 2
ckpt = tmp / "ckpt"
learner.save(ckpt, extra={"data_position": 1})
rows2 = batch(1)
s2 = learner.train_step(shard_rows(rows2, rank, world))
w2 = learner.full_state_dict()
extra = learner.load(ckpt)
s2b = learner.train_step(shard_rows(rows2, rank, world))
w2b = learner.full_state_dict()
# 4. the sampler is the behaviour policy: with its log-probs 4x below the learner's (ratio 4), the truncated
#    importance weight (cap 2) doubles the loss; a band (0.5, 2) masks every token (lr 0: the weights stay)
box = [batch(2, w2b) if rank == 0 else None]  # the full weights are on rank 0 only
dist.broadcast_object_list(box, src=0)
rows3 = box[0]
learner.algo.tis_cap = 2.0
shifted = [Row(r.ids, r.mask, r.adv, [x - math.log(4) for x in r.old_logp]) for r in rows3]
res = {}
for name, rs, band in (("own", rows3, []), ("ratio4", shifted, []), ("band", shifted, [0.5, 2.0])):
    learner.algo.mask_band = band
    for group in learner.opt.param_groups:
        group["lr"] = 0.0
    res[name] = learner.train_step(shard_rows(rs, rank, world))
# 4b. stale samples: the sampler's log-probs moved by +0.3 at even positions, -0.1 at odd ones: the learner's token-
#     and chunk-level mean |log ratio| (and max) are those of the moves, computed by hand on the rows below
move = lambda j: 0.3 if j % 2 == 0 else -0.1  # noqa: E731
learner.algo.tis_cap, learner.algo.mask_band = 0.0, []
stale = learner.train_step(shard_rows([Row(r.ids, r.mask, r.adv, [x + move(j) for j, x in enumerate(r.old_logp)])
                                       for r in rows3], rank, world))
if rank == 0:
    report["tis"] = {k: {s: v[s] for s in ("pg_loss", "tis/truncated_frac", "tis/masked_frac", "mismatch/abs_log_ratio_mean",
                                          "mismatch/abs_log_ratio_max", "mismatch/kl_k3")} for k, v in res.items()}
    chunks, run = [], []  # each chunk's mean move: the runs of action tokens of each row
    for r in rows3:
        for j, m in enumerate(r.mask + [0.0]):
            if m > 0:
                run.append(move(j))
            elif run:
                chunks, run = chunks + [sum(run) / len(run)], []
    moves = [move(j) for r in rows3 for j, m in enumerate(r.mask) if m > 0]
    report["stale"] = {"got": {k.split("/")[1]: stale[k] for k in stale if k.startswith("mismatch/")},
                       "want": {"abs_log_ratio_mean": sum(map(abs, moves)) / len(moves), "abs_log_ratio_max": 0.3,
                                "chunk_abs_log_ratio_mean": sum(map(abs, chunks)) / len(chunks),
                                "chunk_abs_log_ratio_max": max(map(abs, chunks)), "chunks": len(chunks)}}
    report["resume_extra"] = extra
    report["loss_step2"], report["loss_step2_resumed"] = s2["loss"], s2b["loss"]
    report["resume_max_weight_diff"] = max((w2[k] - w2b[k]).abs().max().item() for k in w2)
    report["lr_after"] = [s2["lr"], s2b["lr"]]

# 5. LoRA under FSDP2: only the adapters train; an SFT step on 2 ranks equals a plain peft step on one
#    process; the export is the merged model, whose log-probs are the learner's
cfg.learner.lora_rank, cfg.learner.lr = 4, 1e-2
lora = Learner(folder, cfg.learner, cfg.algo, total_steps=3)
rows4 = [Row(r.ids, r.mask, [float(m > 0) for m in r.mask], r.old_logp) for r in batch(3)]
s4 = lora.train_step(shard_rows(rows4, rank, world), sft=True)
merged = lora.export_hf(tmp / "export_lora")
if rank == 0:
    from transformers import AutoModelForCausalLM

    from l0_min.learner import add_lora

    plain = add_lora(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), cfg.learner)
    trainable = [p for p in plain.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0)
    n = sum(1 for r in rows4 for m in r.mask if m > 0)
    loss = 0.0
    for r in rows4:
        ids = torch.tensor(r.ids)[None]
        logp = torch.log_softmax(plain(ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        l_row = -(logp * torch.tensor(r.mask[1:])).sum() / n
        l_row.backward()
        loss += l_row.item()
    torch.nn.utils.clip_grad_norm_(trainable, 0.5)
    opt.step()
    back = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    with torch.no_grad():
        ids = torch.tensor(rows4[0].ids)[None]
        same = (plain(ids).logits - back(ids).logits).abs().max().item()
    report["lora"] = {"trainable": sum(p.numel() for p in lora.params), "all": sum(p.numel() for p in lora.model.parameters()),
                      "loss": s4["loss"], "loss_ref": loss, "max_logit_diff_vs_plain_peft": same,
                      "keys_as_base": sorted(back.state_dict()) == sorted(base),
                      "base_changed": sum(not torch.equal(back.state_dict()[k], base[k]) for k in base)}

# 6. a tied-embedding model with the KL reference on 2 ranks (each build gets its own copy of rank 0's state
#    dict); the export holds embed_tokens once (no lm_head.weight), and two steps move the policy off the reference
cfg.learner.lora_rank, cfg.learner.lr, cfg.algo.kl_coef = 0, 1e-2, 0.5
if rank == 0:
    from l0_min.models import save_random_llama

    save_random_llama(tmp / "tied", AutoTokenizer.from_pretrained(folder), tie_word_embeddings=True, layers=1)
dist.barrier()
tied = Learner(tmp / "tied", cfg.learner, cfg.algo, total_steps=3)
kl = [tied.train_step(shard_rows(batch(4), rank, world))["kl"] for _ in range(2)]
tied_export = tied.export_hf(tmp / "export_tied")
# 7. with bf16 compute (mixed precision) the KL reference is kept in bf16 (issue 35): half its memory, and what every
#    gather cast the fp32 reference to, so its log-probs are the fp32 policy's at step 0 to bf16 rounding
#    Built as on a host with GPUs (torch's accelerator: CUDA) while learner.device is cpu: the mesh is the learner's
cfg.learner.mixed_precision = True
accelerator, torch._C._get_accelerator = torch._C._get_accelerator, lambda: torch.device("cuda")
mp = Learner(tmp / "tied", cfg.learner, cfg.algo, total_steps=3)
torch._C._get_accelerator = accelerator
ids = torch.tensor(batch(4)[0].ids)
pos = torch.arange(len(ids))
with torch.no_grad():
    lp_ref, lp_mp = (token_logprobs(m, ids, pos) for m in (mp.ref, mp.model))
    cfg.learner.mixed_precision = False
    fp32 = Learner(tmp / "tied", cfg.learner, cfg.algo, total_steps=3)
    lp_fp32 = token_logprobs(fp32.model, ids, pos)
mp_kl = mp.train_step(shard_rows(batch(4), rank, world))["kl"]
if rank == 0:
    from safetensors import safe_open

    with safe_open(str(tied_export / "model.safetensors"), "pt") as f:
        report["tied"] = {"keys": [k for k in f.keys() if "embed" in k or "lm_head" in k], "kl": kl}
    report["bf16_ref"] = {"mesh": sorted({p.device_mesh.device_type for p in mp.model.parameters()}), "ref_dtypes": sorted({str(p.dtype) for p in mp.ref.parameters()}),
                          "policy_dtypes": sorted({str(p.dtype) for p in mp.model.parameters()}),
                          "ref_vs_policy_step0": (lp_ref - lp_mp).abs().max().item(), "kl_step1": mp_kl,
                          "ref_vs_fp32": (lp_ref - lp_fp32).abs().max().item(), "spread": lp_fp32.std().item()}
    out.write_text(json.dumps(report, indent=1))
close_distributed()
