"""The FSDP2 learner: equivalence with a plain step, export, resume, and that it really learns."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def _torchrun(args, tmp_path, timeout=300):
    env = dict(os.environ, L0_MIN_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    p = subprocess.run(TORCHRUN + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("learner")
    _torchrun([str(ROOT / "tests/workers/learner_check.py"), str(tmp / "report.json"), str(tmp)], tmp)
    return json.loads((tmp / "report.json").read_text())


@pytest.mark.slow
def test_two_rank_fsdp_step_equals_single_process_step(report):
    assert report["loss_fsdp"] == pytest.approx(report["loss_ref"], rel=1e-5, abs=1e-7)
    assert report["max_weight_change"] > 1e-3  # the step really moved the weights
    assert report["max_weight_diff"] < 1e-4


@pytest.mark.slow
def test_exported_folder_reloads_bit_exactly(report):
    assert report["export_bit_exact"] is True
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(report["export_files"])
    assert report["export_tokenizer_ok"] is True


@pytest.mark.slow
def test_export_in_the_serving_dtype(report):
    assert report["bf16_absolute"] is True
    assert report["bf16_dtypes"] == ["torch.bfloat16"] and report["bf16_config_dtype"] == "bfloat16"
    assert report["bf16_equal"] is True  # the fp32 masters, rounded once


@pytest.mark.slow
def test_truncated_importance_weights_and_band_give_their_exact_numbers_on_2_ranks(report):
    tis = report["tis"]  # the behaviour policy: the sampler's log-probs against the learner's (prox)
    assert tis["own"]["mismatch/abs_log_ratio_max"] < 1e-5 and tis["own"]["tis/truncated_frac"] == 0.0
    assert tis["ratio4"]["pg_loss"] == pytest.approx(2 * tis["own"]["pg_loss"], rel=1e-4)  # min(4, cap 2)
    assert tis["ratio4"]["tis/truncated_frac"] == 1.0 and tis["ratio4"]["tis/masked_frac"] == 0.0
    assert tis["ratio4"]["mismatch/abs_log_ratio_mean"] == pytest.approx(math.log(4), rel=1e-4)
    assert tis["ratio4"]["mismatch/kl_k3"] == pytest.approx(4 - 1 - math.log(4), rel=1e-4)
    assert tis["band"]["tis/masked_frac"] == 1.0 and tis["band"]["pg_loss"] == 0.0


@pytest.mark.slow
def test_token_and_chunk_log_ratios_of_stale_samples_are_the_hand_computed_ones_on_2_ranks(report):
    """The sampler's log-probs moved by +0.3 / -0.1 at even / odd positions: the learner reports |log ratio| per
    token (mean, max 0.3) and per chunk (|the mean move of an agent step's action|: +0.3 and -0.1 cancel in part, so
    the chunk mean is smaller), within the learner-vs-sampler gap of the unmoved rows (< 1e-5, above)."""
    got, want = report["stale"]["got"], report["stale"]["want"]
    assert want["chunks"] > 5 and want["chunk_abs_log_ratio_mean"] < want["abs_log_ratio_mean"]
    for k in ("abs_log_ratio_mean", "abs_log_ratio_max", "chunk_abs_log_ratio_mean", "chunk_abs_log_ratio_max"):
        assert got[k] == pytest.approx(want[k], abs=1e-5), k


@pytest.mark.slow
def test_lora_on_2_ranks_equals_a_plain_peft_step_and_exports_merged(report):
    lora = report["lora"]  # LoRA under FSDP2 on 2 ranks == a plain peft step on one process, exported merged
    assert 0 < lora["trainable"] < lora["all"] / 4
    assert lora["loss"] == pytest.approx(lora["loss_ref"], rel=1e-5, abs=1e-7)
    assert lora["max_logit_diff_vs_plain_peft"] < 1e-4 and lora["keys_as_base"] and lora["base_changed"] > 0


@pytest.mark.slow
def test_kl_reference_on_2_ranks_and_a_tied_model_exports_its_embedding_once(report):
    tied = report["tied"]  # issue 24: both builds once shared rank 0's dict, and the reference's build crashed
    assert tied["kl"][0] == 0.0 and tied["kl"][1] > 0  # the reference is the step-0 policy; step 2 left it
    assert tied["keys"] == ["model.embed_tokens.weight"]


@pytest.mark.slow
def test_the_kl_reference_is_kept_in_bf16_where_the_learner_computes_in_bf16(report):
    """Issue 35: with mixed precision the reference's weights are bf16 (half of fp32's memory); every gather cast
    them to bf16 anyway, so its log-probs are the step-0 policy's exactly (KL 0 at step 1) and the fp32 model's to
    bf16 rounding (~1e-2 of their spread here; a wrong reference would be of the order of the spread)."""
    ref = report["bf16_ref"]
    assert ref["mesh"] == ["cpu"]  # built as on a GPU host with learner.device=cpu: FSDP2's default mesh was CUDA's
    assert ref["ref_dtypes"] == ["torch.bfloat16"] and ref["policy_dtypes"] == ["torch.float32"]
    assert ref["ref_vs_policy_step0"] == 0.0 and ref["kl_step1"] == 0.0
    assert 0 < ref["ref_vs_fp32"] < 0.05 * ref["spread"], ref


@pytest.mark.slow
def test_resume_reproduces_the_next_step(report):
    assert report["resume_extra"] == {"data_position": 1}
    assert report["loss_step2_resumed"] == report["loss_step2"]
    assert report["resume_max_weight_diff"] == 0.0
    assert report["lr_after"][0] == report["lr_after"][1]


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [0, 1])
def test_learner_raises_reward_of_multistep_env(tmp_path, overlap):
    """The short version of bench/learn.py: random policy (1/16) to >= 0.8 on fresh episodes, also when the
    sampler lags one update behind (overlap 1, corrected by the truncated importance weights)."""
    out = _torchrun([str(ROOT / "bench/learn.py"), "--quick", "--overlap", str(overlap)], tmp_path, timeout=600)
    result = [l for l in out.splitlines() if l.startswith("RESULT final_reward=")]
    assert result, out[-2000:]
    first = float(out.split("first-batch reward=")[1].split()[0])
    final = float(result[0].split("=")[1].split()[0])
    assert first < 0.2, out[-2000:]
    assert final >= 0.8, out[-2000:]


def _tiny_logprob_model(tmp_path, monkeypatch):
    from transformers import AttentionInterface, AutoModelForCausalLM

    from l0_min.learner import PACKED_ATTENTION, LogProbHead, packed_sdpa
    from l0_min.models import resolve_model

    monkeypatch.setenv("L0_MIN_CACHE", str(tmp_path))
    AttentionInterface.register(PACKED_ATTENTION, packed_sdpa)
    path = resolve_model("tiny-random")
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=PACKED_ATTENTION)
    model.lm_head.__class__ = LogProbHead
    return model, AutoModelForCausalLM.from_pretrained(path)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_token_logprobs_of_needed_positions_match_a_plain_forward(tmp_path, monkeypatch, temperature):
    # only the masked-in positions go through the LM head; their values equal log_softmax(logits / T)
    # of a plain per-row forward (T = 0, greedy sampling, means the raw distribution)
    import torch

    from l0_min.learner import token_logprobs

    model, plain_model = _tiny_logprob_model(tmp_path, monkeypatch)
    torch.manual_seed(0)
    ids = torch.randint(3, 250, (50,))
    pos = torch.cat([torch.arange(20), torch.arange(30)])  # two packed rows: 20 and 30 tokens
    need = torch.zeros(50, dtype=torch.bool)
    need[[5, 6, 7, 20, 25, 40, 49]] = True  # 20 starts row 2: never an action, stays 0
    got = token_logprobs(model, ids, pos, need, temperature)
    with torch.no_grad():
        t = temperature or 1.0
        plain = [torch.log_softmax(plain_model(ids[None, a:b]).logits[0, :-1] / t, -1).gather(-1, ids[a + 1 : b, None]).squeeze(-1)
                 for a, b in ((0, 20), (20, 50))]  # fmt: skip
    want = torch.zeros(50)
    want[1:20], want[21:50] = plain
    keep = need & (pos != 0)
    assert torch.allclose(got[keep], want[keep], atol=1e-5)
    assert got[~keep].abs().max() == 0
    assert torch.allclose(token_logprobs(model, ids, pos, temperature=temperature)[keep], got[keep], atol=1e-5)
    # a filler with nothing needed still reaches every weight (FSDP ranks must all run backward)
    token_logprobs(model, ids[:4], torch.arange(4), torch.zeros(4, dtype=torch.bool)).sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_chunked_logprob_head_equals_one_chunk(tmp_path, monkeypatch):
    """The LM head in chunks of 3 positions (each recomputed in backward) gives the log-probs and the
    gradients of one chunk over all 40 positions."""
    import torch

    from l0_min.learner import LogProbHead, token_logprobs

    model, _ = _tiny_logprob_model(tmp_path, monkeypatch)
    torch.manual_seed(1)
    ids, pos, t = torch.randint(3, 250, (40,)), torch.cat([torch.arange(25), torch.arange(15)]), 0.7
    runs, hs = [], []
    model.lm_head.register_forward_hook(lambda m, args, out: hs.append(args[0].detach().flatten(0, -2)))
    for chunk in (3, 4096):
        monkeypatch.setattr(LogProbHead, "chunk", chunk)
        model.zero_grad()
        logp = token_logprobs(model, ids, pos, temperature=t)
        (logp * torch.linspace(-1, 1, 40)).sum().backward()
        runs.append((logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (a, ga), (b, gb) = runs
    # The tolerance, from the arithmetic: the model's body runs the same ops on the same input (its hidden
    # states are equal, checked), so only the head's fp32 matmul differs, 3 rows at a time or 40: BLAS may
    # sum each logit's d = hidden_size products in another order (AVX2 and AVX-512 kernels block differently).
    # Each order is within gamma_d * S of the exact logit (Higham: gamma_n = n u / (1 - n u), u = 2^-24; S the
    # largest sum_i |h_i w_i| over positions and tokens), so the two differ by at most 2 gamma_d S; log p =
    # z_target / T - logsumexp(z / T) by at most twice that / T, plus 2 gamma_V for logsumexp's own sum of V terms.
    # The gradients are linear in the head's softmax, whose relative change that same bound caps. (Measured:
    # 1.9e-6 on AVX-512 and 5.7e-6 with ATEN_CPU_CAPABILITY=avx2; a wrong chunk boundary moves log p by ~1.)
    gamma = lambda n: n * 2.0**-24 / (1 - n * 2.0**-24)  # noqa: E731
    assert torch.equal(hs[0], hs[1])
    w = model.lm_head.weight.detach()
    bound = 4 * gamma(w.shape[1]) * (hs[0].abs() @ w.abs().T).max().item() / t + 2 * gamma(w.shape[0])
    assert (a - b).abs().max() <= bound, ((a - b).abs().max(), bound)  # bound: 7.2e-4 here
    assert all((ga[n] - gb[n]).abs().max() <= (bound + gamma(40)) * ga[n].abs().max() for n in ga)


def test_memory_estimate_is_the_hand_computation_for_qwen25_3b_and_stops_start_up_when_it_cannot_fit(monkeypatch):
    """Issue 35: Qwen2.5-3B (3,085,938,688 parameters, tied; h 2048, i 11008, 36 layers, 2 K/V heads of 128) on 4
    ranks with the KL reference, bf16, full checkpointing, micro-batches of 32,768, by hand; on a GPU that holds
    less than that free, start-up stops with one line naming what is in use."""
    import torch
    from transformers import Qwen2Config

    from l0_min import learner
    from l0_min.config import Config

    config = Qwen2Config(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                         num_attention_heads=16, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    n = 151936 * 2048 + 36 * (2048 * 2048 + 2048 + 2 * (2048 * 256 + 256) + 2048 * 2048 + 3 * 2048 * 11008 + 2 * 2048) + 2048
    assert n == 3_085_938_688
    cfg = Config().learner
    cfg.micro_batch_tokens, cfg.activation_checkpointing = 32768, "full"
    got = learner.memory_estimate(config, n, n, cfg, world=4, mixed=True, ref=True)
    gib = 2**30
    want = {"weights": 4 * n / 4 / gib, "grads": 4 * n / 4 / gib, "AdamW": 8 * n / 4 / gib, "reference": 2 * n / 4 / gib,
            # the root (the tied embedding) and two decoder layers' bf16 copies
            "gathered": (151936 * 2048 + 2 * (n - 151936 * 2048) / 36) * 2 / gib,
            # each layer's input; the larger of one layer's recompute ((8 h + 5 i) 2 B) and the head's chunk
            # (2048 x vocab x 11 B); the head's fp32 dW and dh
            "activations": (36 * 2048 * 2 * 32768 + max((8 * 2048 + 5 * 11008) * 2 * 32768, 2048 * 151936 * 11)
                            + 151936 * 2048 * 4 + 32768 * 2048 * 4) / gib}  # fmt: skip
    assert got == pytest.approx(want, rel=1e-12)
    assert [round(x, 2) for x in got.values()] == [2.87, 2.87, 5.75, 1.44, 0.87, 10.27]  # 24.1 GiB a rank
    one = learner.memory_estimate(config, n, n, cfg, world=1, mixed=True, ref=False)
    assert sum(one.values()) == pytest.approx(57.1, abs=0.05)  # one H100 measured 57.0 (docs/gpu.md)

    with pytest.raises(learner.NoRoom, match=r"the learner needs ~24.1 GiB on GPU 3 \(weights 2.9, grads 2.9, AdamW 5.7, "
                       r"reference 1.4, gathered 0.9, activations 10.3, per micro-batch of 32768 tokens\) of 10.0 free of "
                       r"80.0: 70.0 GiB are in use \(an inference server\?\); none of "):  # fmt: skip
        learner.check_memory(config, n, n, cfg, 4, True, True, (10.0, 80.0), 3)
    monkeypatch.setattr(learner.dist, "get_rank", lambda: 1)  # fits: rank 0 alone says so
    learner.check_memory(config, n, n, cfg, 4, True, True, (25.0, 80.0), 3)


def test_a_refused_start_names_what_would_fit_each_with_its_estimate():
    """Issue 45: one 80 GB GPU beside SGLang (--mem-fraction-static 0.3: ~45 GiB left): the 3B learner (62.9 GiB with
    its KL reference, 57.1 without) cannot fit; a smaller micro-batch cannot help, so the line names what can: LoRA
    and more ranks, each with its estimate (by memory_estimate, which test above pins by hand); with nothing that fits,
    a smaller model. Every estimate in the line is memory_estimate's for that setting."""
    from transformers import Qwen2Config

    from l0_min import learner
    from l0_min.config import Config

    config = Qwen2Config(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                         num_attention_heads=16, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    n, cfg = 3_085_938_688, Config().learner
    cfg.micro_batch_tokens, cfg.activation_checkpointing = 32768, "full"
    est = lambda c=cfg, nt=n, w=1, ref=True: round(sum(learner.memory_estimate(config, n, nt, c, w, True, ref).values()), 1)
    lora = 16 * 36 * (9 * 2048 + 2 * 256 + 3 * 11008)  # q, k, v, o, gate, up, down: r x (in + out) each
    assert (est(), est(ref=False), est(nt=lora), est(w=2), est(w=8)) == (62.9, 57.1, 28.7, 37.0, 17.6)

    def refusal(free: float, c=cfg) -> str:
        with pytest.raises(learner.NoRoom) as e:
            learner.check_memory(config, n, n, c, 1, True, True, (free, 79.2), 0)
        assert "\n" not in str(e.value)
        return str(e.value).split("are in use (an inference server?); ")[1]

    assert refusal(45.0) == "it would fit with learner.lora_rank=16 (~28.7 GiB), 2 ranks (~37.0 GiB)"
    assert refusal(58.0) == "it would fit with algo.kl_coef=0 (~57.1 GiB), learner.lora_rank=16 (~28.7 GiB), 2 ranks (~37.0 GiB)"
    assert refusal(5.0) == ("none of algo.kl_coef=0 (~57.1 GiB), learner.lora_rank=16 (~28.7 GiB), 8 ranks (~17.6 GiB) "
                            "fits: a smaller model")
    selective = Config().learner
    selective.micro_batch_tokens, selective.activation_checkpointing = 32768, "selective"
    assert est(selective) == 125.9 and est(selective, w=8) > 70  # selective's activations are not sharded
    assert refusal(70.0, selective) == "it would fit with learner.activation_checkpointing=full (~62.9 GiB)"


def test_learner_device_cuda_without_cuda_stops_with_the_reason(monkeypatch):
    """learner.device=cuda where torch cannot use CUDA: one line with the cause (detection mocked here: torch's
    CUDA build and what nvidia-smi reports). `auto` would fall back to CPU; a bad value names the field."""
    import subprocess

    import torch

    from l0_min import distributed as learner

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def smi(out: str, gpus: str):
        def run(argv, **kw):
            return subprocess.CompletedProcess(argv, 0, gpus if argv[1:] == ["-L"] else out, "")

        return run

    def reason() -> str:
        with pytest.raises(RuntimeError) as e:
            learner.init_distributed(device="cuda")
        return str(e.value)

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(learner.subprocess, "run", smi("| Driver Version: 550.54.15   CUDA Version: 12.4 |", "GPU 0: H100\nGPU 1: H100\n"))
    assert learner.nvidia_smi() == (2, "12.4")
    assert "sees 2 GPU(s) but the driver supports CUDA 12.4 and torch is built for CUDA 13.0: update the driver" in reason()
    monkeypatch.setattr(learner.subprocess, "run", smi("| CUDA Version: 13.0 |", "GPU 0: H100\n"))
    assert "driver CUDA 13.0, torch built for CUDA 13.0; check CUDA_VISIBLE_DEVICES" in reason()

    def missing(argv, **kw):
        raise FileNotFoundError(argv[0])

    monkeypatch.setattr(learner.subprocess, "run", missing)
    assert learner.nvidia_smi() is None and "nvidia-smi finds no GPU" in reason()
    monkeypatch.setattr(torch.version, "cuda", None)
    assert "it is a CPU build" in reason()
    with pytest.raises(ValueError, match="learner.device: expected auto, cuda or cpu, got 'gpu'"):
        learner.init_distributed(device="gpu")


# -- the speed paths of issue 27 (learner.attention, activation_checkpointing, compile; the fused LM head) --


@pytest.fixture(scope="module")
def fast_paths(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("learner_fast")
    _torchrun([str(ROOT / "tests/workers/learner_fast_check.py"), str(tmp / "report.json"), str(tmp)], tmp)
    return json.loads((tmp / "report.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["full", "selective", "gathered", "units", "varlen", "compiled"])
def test_each_speed_path_gives_the_eager_step_on_2_ranks(fast_paths, variant):
    """One FSDP2 step on 2 gloo ranks with each option = the eager step (one SDPA per row, nothing recomputed,
    nothing compiled, weights gathered per layer and micro-batch). Recomputation (and gathering once a step, or
    several layers at once) replays the same fp32 ops (equal up to a BLAS that sums in an order that
    depends on memory alignment: a few ulps, 1e-6). The varlen path's attention (a dense masked SDPA double on
    CPU) sums the same products in another order: fp32 rounding, ~1e-7 relative per op, grown through 4
    layers and the softmax's exp to < 1e-4 of the largest gradient (measured 2e-5)."""
    eager, got = fast_paths["eager"], fast_paths[variant]
    tol = 1e-6 if variant in ("full", "selective", "gathered", "units") else 1e-4
    assert got["params"] == eager["params"]  # the options rename nothing (checkpoints, export)
    assert got["resharded"]  # learner.reshard false: the weights gathered for the step are freed at its end
    assert got["loss"] == pytest.approx(eager["loss"], rel=tol / 10)
    assert got["grad_norm"] == pytest.approx(eager["grad_norm"], rel=tol / 10)
    assert got["max_grad_diff"] <= tol
    assert (eager["fsdp_units"], got["fsdp_units"]) == (4, 2 if variant == "units" else 4)  # learner.fsdp_unit: 3 + 1
    if variant == "compiled":  # the 4 layers share one graph (and a new length does not recompile): with the LM
        # head's 2 kernels, 3 graphs, + 2 where a 1-position filler micro-batch specializes the kernels (size 1)
        assert 0 < got["graphs"]["unique_graphs"] <= 5, got["graphs"]


@pytest.mark.slow
def test_the_mfu_bench_runs_every_row_and_profiles_on_cpu(tmp_path):
    """bench/learner.py --mfu on CPU (a tiny shape; on a GPU, issue 27's table): the before row, the after row
    (gpu_example.yaml's learner, on CPU with aot_eager), a --variant row, each one's log-probs equal the before
    row's within bf16 noise, and --profile's breakdown of where each step's time goes."""
    env = dict(os.environ, L0_MIN_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "bench/learner.py", "--mfu", "--profile", "--variant", "gathered",
                        "learner.reshard=false"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    out = p.stdout
    assert p.returncode == 0 and "FAILED" not in out, out[-3000:] + p.stderr[-3000:]
    assert "after: attention=auto activation_checkpointing=full compile=aot_eager reshard=True" in out
    assert "gathered: attention=auto activation_checkpointing=full compile=aot_eager reshard=False" in out
    table = [line.split() for line in out.splitlines() if line.startswith("tiny ")]
    assert [r[1] for r in table if "/" not in r[1] and r[2] != "profile:"] == ["before", "after", "gathered"]
    assert [r[1] for r in table if r[-1] in ("PASS", "FAIL")] == ["after/before", "gathered/before"]
    assert all(r[-1] == "PASS" for r in table if r[-1] in ("PASS", "FAIL"))
    for row in ("after", "gathered"):  # the profile: per kind of op, its share; the kinds add up to 100%
        block = out.split(f"tiny {row} profile:")[1].split("longest ops")[0].splitlines()[1:-1]
        shares = {line[:36].strip(): float(line.split()[-1].rstrip("%")) for line in block}
        assert shares["matmul"] > 0 and shares["attention"] > 0, block
        assert sum(shares.values()) == pytest.approx(100, abs=0.1 * len(shares))  # each rounded to 0.1%
    assert "graphs compiled" in out


@pytest.mark.slow
def test_the_mfu_bench_cut_off_by_a_time_limit_keeps_the_rows_it_finished(tmp_path):
    """Issue 35: a GPU run killed by its time limit keeps each finished row's line and RESULT: they are printed as the
    row ends, the after rows first. Killed here in the next row, as soon as the after row's RESULT line is out."""
    import signal

    env = dict(os.environ, L0_MIN_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "bench/learner.py", "--mfu", "--no-before", "--variant", "units4@3b",
                          "learner.fsdp_unit=4"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)  # fmt: skip
    lines = []
    for line in p.stdout:
        lines.append(line.rstrip("\n"))
        if line.startswith("RESULT"):
            p.send_signal(signal.SIGKILL)
            break
    p.wait(timeout=60)
    out = "\n".join(lines)
    assert p.returncode == -signal.SIGKILL, out[-3000:]
    assert "rows, in order: tiny after, tiny units4" in out  # on CPU each variant runs at the tiny shape
    row = [line.split() for line in lines if line.startswith("tiny   after")]
    assert len(row) == 1 and float(row[0][2].replace(",", "")) > 0, out[-3000:]  # its tokens/s
    assert lines[-1].startswith("RESULT learner_mfu_tiny=") and "total" not in out


@pytest.mark.slow
def test_a_step_reads_nothing_back_from_the_device_per_micro_batch(fast_paths):
    """On a GPU each read of a tensor (.item(), float(), a bool, nonzero, .tolist()) stalls the host until the device
    has caught up, and the device then waits for the host's next launches. The learner's own reads in one RL step
    (tests/workers/learner_fast_check.py counts them) are the same with one micro-batch as with many: the step's
    counts at its start and its sums at its end, none per micro-batch (shapes are worked out on the host)."""
    assert fast_paths["unit_error"] == "learner.fsdp_unit: expected >= 1 decoder layers, got 0"
    (many, reads_many), (one, reads_one) = fast_paths["host_reads"]
    assert many >= 4 and one == 1, fast_paths["host_reads"]
    assert reads_many == reads_one, fast_paths["host_reads"]
    assert reads_one > 0  # the counter sees the step's own reads (its start and end)


def test_fused_logprob_head_equals_autograd_of_log_softmax():
    """_LinearLogProb's hand-written backward ((onehot - softmax) * g / T into dh and dW, in chunks) equals
    autograd through log_softmax(h W^T / T): fp32, the same products summed in another order."""
    import torch

    from l0_min.learner import LogProbHead, _LinearLogProb

    torch.manual_seed(0)
    h, w = torch.randn(37, 16, requires_grad=True), (0.5 * torch.randn(50, 16)).requires_grad_()
    b, t, g = torch.randn(50, requires_grad=True), torch.randint(50, (37,)), torch.randn(37)
    got = _LinearLogProb.apply(h, w, b, t, 1 / 0.7, 8, LogProbHead.kernels).reshape(-1)
    grads = torch.autograd.grad((got * g).sum(), (h, w, b))
    want = torch.log_softmax((h @ w.T + b) / 0.7, -1).gather(-1, t[:, None]).squeeze(-1)
    ref = torch.autograd.grad((want * g).sum(), (h, w, b))
    assert torch.allclose(got, want, atol=1e-5)  # |log p| < ~20: a few fp32 ulps
    for x, y in zip(grads, ref):
        assert (x - y).abs().max() <= 1e-5 * y.abs().max()


def _varlen_double(calls=None):
    """torch's varlen_attn as a dense masked SDPA (CPU): causal within each row, K/V heads shared where enable_gqa."""
    import torch
    import torch.nn.functional as F

    def double(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        assert window_size == (-1, 0) and (enable_gqa or k.shape[1] == q.shape[1])
        if calls is not None:
            calls.append((k.shape[1], max_q))
        t = torch.arange(q.shape[0])
        row = torch.searchsorted(cu_q[1:].long(), t, right=True)
        mask = (row[:, None] == row[None, :]) & (t[:, None] >= t[None, :])
        return F.scaled_dot_product_attention(*(x.transpose(0, 1) for x in (q, k, v)), attn_mask=mask, scale=scale,
                                              enable_gqa=enable_gqa).transpose(0, 1)  # fmt: skip

    return double


def test_varlen_adapter_equals_one_sdpa_per_row(monkeypatch):
    """packed_varlen with torch's varlen_attn (K/V heads shared by the kernel, or repeated where it cannot: torch
    2.11 has no enable_gqa) gives packed_sdpa's output; the kernel is a dense masked SDPA double here."""
    import torch
    import torch.nn.attention.varlen as varlen

    from l0_min import learner

    calls = []
    monkeypatch.setattr(varlen, "varlen_attn", _varlen_double(calls))
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 12, 8), torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)  # 2 K/V heads for 4
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    module = torch.nn.Module()
    module.num_key_value_groups = 2
    want, _ = learner.packed_sdpa(module, q, k, v, None, scaling=0.3, cu_seq_lens_q=cu)
    for repeat in (False, True):
        got, _ = learner.packed_varlen(module, q, k, v, None, scaling=0.3, cu_seq_lens_q=cu, max_length_q=7,
                                       kernel=learner._torch_varlen(repeat))  # fmt: skip
        assert calls[-1] == (4 if repeat else 2, 7)
        assert got.shape == want.shape == (1, 12, 4, 8)
        assert torch.allclose(got, want, atol=1e-6)  # fp32 softmax over <= 7 keys


def test_the_varlen_kernel_is_the_first_that_imports_runs_and_is_right(tmp_path, monkeypatch, capsys):
    """Issue 35: SGLang's flash-attn-4 wheel leaves `flash_attn` an empty namespace package (find_spec finds it,
    `from flash_attn import flash_attn_varlen_func` fails); a flash_attn whose kernel raises (no kernel image for
    this GPU) or is wrong is passed over too. Each time torch's kernel is taken, with one line saying why the
    others were not; and learner.attention=varlen where none runs (CPU, fp32) stops start-up with one line."""
    import torch
    import torch.nn.attention.varlen as varlen

    from l0_min import learner

    cpu, f32 = torch.device("cpu"), torch.float32
    with pytest.raises(ValueError, match=r"^learner.attention=varlen: no varlen kernel runs on cpu in float32 \(torch_varlen: "
                       r"NotImplementedError: .*; use auto or rows \(varlen needs CUDA and learner.mixed_precision\)$"):
        learner._attention("varlen", cpu, f32)
    monkeypatch.setattr(varlen, "varlen_attn", _varlen_double())
    fakes = {"empty": None, "raises": "raise RuntimeError('CUDA error: no kernel image is available for execution')",
             "wrong": "return q * 0.5"}  # fmt: skip
    why = {"empty": "flash_attn: AttributeError: module 'flash_attn' has no attribute 'flash_attn_varlen_func'",
           "raises": "flash_attn: RuntimeError: CUDA error: no kernel image is available for execution",
           "wrong": "flash_attn: ValueError: wrong output: max |difference| to one SDPA per row"}  # fmt: skip
    for case, body in fakes.items():
        pkg = tmp_path / case / "flash_attn"
        pkg.mkdir(parents=True)  # "empty": a directory without __init__.py, a namespace package
        if body:
            (pkg / "__init__.py").write_text(f"import torch\ndef flash_attn_varlen_func(q, k, v, **kw):\n    {body}\n")
        with monkeypatch.context() as m:
            m.syspath_prepend(str(tmp_path / case))
            m.delitem(sys.modules, "flash_attn", raising=False)
            kernel, name, skipped = learner.varlen_kernel(cpu, f32)
            assert name == "torch_varlen" and kernel is not None and skipped.startswith(why[case]), (case, skipped)
            assert learner._attention("varlen", cpu, f32) == learner.VARLEN_ATTENTION
            assert capsys.readouterr().err == f"learner: attention torch_varlen; passed over {skipped}\n"
        sys.modules.pop("flash_attn", None)
    assert learner.varlen_kernel(cpu, f32)[1:] == ("torch_varlen", "")  # none installed: nothing passed over


def test_speed_settings_name_the_field_when_wrong(tmp_path, monkeypatch):
    import torch

    from l0_min import learner
    from l0_min.config import ConfigError, resolve

    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
    with pytest.raises(ValueError, match=r"learner.activation_checkpointing: unknown 'some' \(none \| full \| selective\)"):
        learner.apply_activation_checkpointing(model, "some")
    with pytest.raises(ValueError, match=r"learner.attention: unknown 'flash' \(auto \| rows \| varlen\)"):
        learner._attention("flash", torch.device("cpu"), torch.float32)
    monkeypatch.setattr(learner, "varlen_kernel", lambda device, dtype: (None, None, ""))
    with pytest.raises(ValueError, match=r"learner.attention=varlen: no varlen kernel runs on cuda in bfloat16 \(none"):
        learner._attention("varlen", torch.device("cuda"), torch.bfloat16)
    assert learner._attention("auto", torch.device("cuda"), torch.bfloat16) == learner.PACKED_ATTENTION  # one per row
    # an older config's bool still loads (true = full), a string too; anything else names the key
    assert resolve(["learner.activation_checkpointing=true"]).learner.activation_checkpointing is True
    assert resolve(["learner.activation_checkpointing=selective"]).learner.activation_checkpointing == "selective"
    with pytest.raises(ConfigError, match="learner.activation_checkpointing: expected"):
        resolve(["learner.activation_checkpointing=[1]"])


def test_selective_checkpointing_recomputes_no_matmul_and_full_recomputes_them_all(tmp_path, monkeypatch):
    """Counted in backward: "full" reruns each layer's forward (its attention and matmuls: q, k, v, o, gate, up;
    not down, whose output no backward needs: the recompute stops early); "selective" keeps the matmul and
    attention outputs and reruns only the elementwise ops."""
    import collections

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from l0_min.learner import apply_activation_checkpointing, token_logprobs

    class Count(TorchDispatchMode):
        def __enter__(self):
            self.ops = collections.Counter()
            return super().__enter__()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func).rsplit(".", 1)[0]] += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    ids, pos = torch.randint(3, 250, (30,)), torch.cat([torch.arange(12), torch.arange(18)])
    backward = {}
    for mode in ("none", "full", "selective"):
        model, _ = _tiny_logprob_model(tmp_path, monkeypatch)
        apply_activation_checkpointing(model, mode)
        logp = token_logprobs(model, ids, pos)
        with Count() as count:
            logp.sum().backward()
        backward[mode] = count.ops
    layers = model.config.num_hidden_layers
    mm = lambda ops: ops["aten.mm"] + ops["aten.addmm"]
    attn = lambda ops: ops["aten._scaled_dot_product_flash_attention_for_cpu"]
    assert mm(backward["full"]) - mm(backward["none"]) == 6 * layers
    assert attn(backward["full"]) - attn(backward["none"]) == 2 * layers  # 2 rows per layer
    assert mm(backward["selective"]) == mm(backward["none"]) and attn(backward["selective"]) == attn(backward["none"])
    assert backward["selective"]["aten.mul"] > backward["none"]["aten.mul"]  # the elementwise chains, recomputed
