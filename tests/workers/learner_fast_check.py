"""Run under torchrun by tests/test_learner.py: every learner speed path gives the eager path's numbers.

On 2 gloo ranks (FSDP2), tiny-random's shape with 4 layers, one global batch: the eager learner (one SDPA per row, no activation
checkpointing, no compile) and learners with the options of issue 27 each take one step from the same
weights; argv[1] gets each one's loss, grad norm and gradients' largest difference from the eager ones.

The varlen kernel is CUDA-only: here torch's `varlen_attn` is replaced by a test double with torch 2.11's
signature (no `enable_gqa`) that computes the same causal-within-rows attention as a dense masked SDPA, so
the adapter (layout, K/V head repeat, causality flag, row bounds) runs for real; bench/gpu_smoke.py checks
the real kernel against the eager path on CUDA.
"""

import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch.nn.attention.varlen  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from l0_min.config import Config, resolve  # noqa: E402
from l0_min.episode import Row  # noqa: E402
from l0_min.distributed import close_distributed, init_distributed  # noqa: E402
from l0_min.learner import Learner, pack_rows, shard_rows  # noqa: E402
from l0_min.models import save_random_llama, tiny_tokenizer  # noqa: E402


def varlen_double(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
    assert window_size == (-1, 0) and k.shape[1] == q.shape[1], (window_size, q.shape, k.shape)  # causal, K/V repeated
    t = torch.arange(q.shape[0])
    row = torch.searchsorted(cu_q[1:].long(), t, right=True)
    mask = (row[:, None] == row[None, :]) & (t[:, None] >= t[None, :])
    out = F.scaled_dot_product_attention(*(x.transpose(0, 1) for x in (q, k, v)), attn_mask=mask, scale=scale)
    if not torch.compiler.is_compiling():  # the longest row, computed once per micro-batch
        assert max_q == max_k == int((cu_q[1:] - cu_q[:-1]).max())
    return out.transpose(0, 1)


torch.nn.attention.varlen.varlen_attn = varlen_double
torch.set_num_threads(1)
rank, world, _ = init_distributed()
path = Path(sys.argv[2]) / "tiny4"  # tiny-random's shape with 4 layers: one compiled graph must serve them all
if rank == 0:
    save_random_llama(path, tiny_tokenizer(), layers=4)
dist.barrier()

g = torch.Generator().manual_seed(0)
rows = []
for _ in range(9):  # uneven lengths; micro-batches of up to 64 tokens hold several rows
    n = 6 + int(torch.randint(30, (1,), generator=g))
    mask = [0.0, 0.0] + [float(torch.rand(1, generator=g) < 0.6) for _ in range(n - 2)]
    rows.append(Row(torch.randint(3, 250, (n,), generator=g).tolist(), mask,
                    [m * float(torch.randn(1, generator=g)) for m in mask], [0.0] * n))  # fmt: skip
mine = shard_rows(rows, rank, world)

GPU = resolve(config_file=Path(__file__).resolve().parents[2] / "configs/gpu_example.yaml").learner
assert GPU.compile == "inductor" and GPU.attention == "auto"  # what "compiled" stands for
VARIANTS = {
    "eager": {},
    "full": {"activation_checkpointing": True},  # a bool of an older config: full
    "selective": {"activation_checkpointing": "selective"},
    "varlen": {"attention": "varlen"},
    "gathered": {"reshard": False},  # configs/cpu_*.yaml: the weights gathered once a step, not per micro-batch
    "units": {"fsdp_unit": 3},  # FSDP units of 3 decoder layers and 1 (the 4 layers' remainder)
    # configs/gpu_example.yaml's fast path, with the varlen double (auto is rows on CPU) and aot_eager: dynamo +
    # AOTAutograd's recompute partition without inductor's C++ build, which takes minutes on CPU (inductor's
    # kernels: bench/gpu_smoke.py on CUDA)
    "compiled": {"activation_checkpointing": GPU.activation_checkpointing, "attention": "varlen", "compile": "aot_eager"},
}
report = {}
for name, options in VARIANTS.items():
    cfg = Config()
    cfg.algo.tis_cap = 0.0  # the plain gradient: nothing depends on the (rounded) start-of-step log-probs
    cfg.learner.lr, cfg.learner.micro_batch_tokens, cfg.learner.grad_clip = 1e-3, 64, 1e9
    for k, v in options.items():
        setattr(cfg.learner, k, v)
    learner = Learner(path, cfg.learner, cfg.algo, total_steps=2, temperature=0.7)
    stats = learner.train_step(mine)
    grads = {n: p.grad.full_tensor() for n, p in learner.model.named_parameters()}  # this step's (clip: 1e9)
    if name == "eager":
        eager = grads
    diff = max(((grads[n] - eager[n]).abs().max() / eager[n].abs().max()).item() for n in grads)
    report[name] = {"loss": stats["loss"], "grad_norm": stats["grad_norm"], "max_grad_diff": diff,
                    "resharded": all(isinstance(p, DTensor) for p in learner.model.parameters()),  # the next step gathers
                    "graphs": dict(counters["stats"]), "params": sorted(grads),
                    "fsdp_units": len({id(fully_shard.state(m)) for m in learner.model.model.layers})}  # fmt: skip
    del learner


def host_reads(budget: int) -> tuple[int, int]:
    """(micro-batches, calls of the learner's own code that read a tensor back to the host) in one RL step of the
    GPU path's settings (varlen attention, behaviour weights, a band, the KL reference): on a GPU each is a sync
    that stalls the host until the device catches up. `_concat` works out shapes from host tensors: not counted."""
    cfg = Config()
    cfg.learner.attention, cfg.learner.micro_batch_tokens, cfg.algo.tis_cap, cfg.algo.mask_band = "varlen", budget, 2.0, [0.1, 10.0]
    cfg.algo.kl_coef = 1e-3
    learner, count = Learner(path, cfg.learner, cfg.algo, total_steps=2, temperature=0.7), [0]
    originals = {name: getattr(torch.Tensor, name) for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "nonzero")}

    def counted(f):
        def call(*a, **k):
            frames = [fr for fr, _ in traceback.walk_stack(sys._getframe(1))]
            own = frames[0].f_code.co_filename.endswith(("l0_min/learner.py", "l0_min/loss.py"))
            count[0] += own and not any(fr.f_code.co_name == "_concat" for fr in frames)
            return f(*a, **k)
        return call

    for name, f in originals.items():
        setattr(torch.Tensor, name, counted(f))
    nonzero, torch.nonzero = torch.nonzero, counted(torch.nonzero)
    try:
        learner.train_step(mine)
    finally:
        for name, f in originals.items():
            setattr(torch.Tensor, name, f)
        torch.nonzero = nonzero
    return len(pack_rows(mine, budget)), count[0]


report["host_reads"] = [host_reads(32), host_reads(512)]  # many micro-batches, then one
cfg = Config()
cfg.learner.fsdp_unit = 0
try:
    Learner(path, cfg.learner, cfg.algo)
except ValueError as e:
    report["unit_error"] = str(e)
if rank == 0:
    Path(sys.argv[1]).write_text(json.dumps(report))
dist.barrier()
close_distributed()
