"""The records that flow from the rollout to the learner: Task -> Episode(steps) -> training rows.

A Step keeps the exact context ids sent and the action ids and log-probs returned. Within one context segment the
context only grows (steps[i+1].context_ids == steps[i].context_ids + steps[i].action_ids + observation), so the
segment trains as one sequence with every step's action span masked in (`segment_rows`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

from l0_min import algo


@dataclass
class Task:
    id: str
    question: str
    answers: list[str]  # gold answer and its aliases (what the environment's score() compares with)
    meta: dict = field(default_factory=dict)
    env: str = "qa"  # the name of its environment (l0_min.envs): prompt, tools, workspace, score


# Episode statuses. "answered" is the only one that ends by the agent's own choice.
ANSWERED = "answered"
MAX_STEPS = "max_steps"
MAX_TOKENS = "max_tokens"
TIMEOUT = "timeout"  # wall-time budget of the episode
ENV_ERROR = "env_error"  # sandbox / kernel / tool backend failure: not the policy's fault
KERNEL_CRASHED = "kernel_crashed"  # the agent's own code killed or broke its kernel: the policy's fault
INFERENCE_ERROR = "inference_error"
STATUSES = (ANSWERED, MAX_STEPS, MAX_TOKENS, TIMEOUT, ENV_ERROR, KERNEL_CRASHED, INFERENCE_ERROR)


@dataclass
class Step:
    context_ids: list[int]  # exactly what was sent to the server
    action_ids: list[int]  # exactly what the server sampled
    action_logprobs: list[float]  # the server's log-probs of those ids
    action_text: str = ""  # agent.prefill (context, not action) + the decoded action ids
    think: str = ""
    code: str = ""
    observation: str = ""  # the text shown back to the model after this action
    format_ok: bool = False
    exec_ok: bool | None = None  # None: no code ran (so it does not count for the execution reward)
    finish_reason: str = ""
    weight_version: str = ""
    segment: int = 0  # index of the append-only context segment this step belongs to
    reward: float = 0.0  # per-step reward, filled by rewards.score_episode
    seconds: float = 0.0
    prefix: bool = False  # an expert's step the episode was started from (rollout.resample): context, never trained
    served: list = field(default_factory=list)  # what the host's tools served while its cell ran (ToolServer.served)


@dataclass
class Episode:
    task: Task
    steps: list[Step] = field(default_factory=list)
    final_answer: str | None = None
    status: str = MAX_STEPS
    group: int = 0  # index of the task group within a batch
    sample: int = 0  # index within its group
    reward: float = 0.0  # total (outcome) reward
    rewards: dict = field(default_factory=dict)  # components: core, format, exec, total, the env's metrics
    tool_calls: dict = field(default_factory=dict)
    truncations: int = 0  # context rebuilds
    weight_version: str = ""
    error: str = ""
    seconds: float = 0.0
    masked: bool = False  # kept for batch shape and stats, trains with zero weight

    @property
    def n_action_tokens(self) -> int:
        """The policy's own action tokens (an expert prefix's are context)."""
        return sum(len(s.action_ids) for s in self.steps if not s.prefix)

    @property
    def prefix_steps(self) -> int:
        return sum(s.prefix for s in self.steps)

    def to_json(self) -> dict:
        """A JSON-able dict. A step that extends its predecessor's context + action (one segment) holds only
        the ids it adds (`context_new`): an episode's record grows with its longest context, not steps x context.

        >>> s0, s1 = Step([1, 2], [3], [-0.5]), Step([1, 2, 3, 9], [4], [-0.1])
        >>> d = Episode(Task("t", "q", []), [s0, s1]).to_json()
        >>> d["steps"][0]["context_ids"], d["steps"][1]["context_new"], "context_ids" in d["steps"][1]
        ([1, 2], [9], False)
        >>> Episode.from_json(d).steps == [s0, s1]
        True
        """
        d = asdict(replace(self, steps=[]))
        for prev, s in zip([None, *self.steps], self.steps):
            rec = {f.name: getattr(s, f.name) for f in fields(Step)}  # the lists themselves: no copy
            n = len(prev.context_ids) + len(prev.action_ids) if prev else 0
            if prev and s.segment == prev.segment and s.context_ids[:n] == prev.context_ids + prev.action_ids:
                rec["context_new"] = rec.pop("context_ids")[n:]
            d["steps"].append(rec)
        return d

    @staticmethod
    def from_json(d: dict) -> "Episode":
        steps: list[Step] = []
        for s in d["steps"]:
            if "context_new" in s:  # see to_json
                s = {**s, "context_ids": steps[-1].context_ids + steps[-1].action_ids + s["context_new"]}
                del s["context_new"]
            steps.append(Step(**s))
        return Episode(**{**d, "task": Task(**d["task"]), "steps": steps})


@dataclass
class Row:
    """One training sequence: token ids, which of them are actions, their advantage and old log-prob."""

    ids: list[int]
    mask: list[float]  # 1.0 on action tokens (times the sample weight), 0.0 elsewhere
    adv: list[float]  # per-token advantage (0 where mask is 0)
    old_logp: list[float]  # sampler log-prob per token (0 where mask is 0)

    def __len__(self) -> int:
        return len(self.ids)


def segment_rows(ep: Episode, step_adv: list[float], weight: float = 1.0) -> list[Row]:
    """Pack an episode into one row per context segment, each action span masked in (an expert prefix's are
    context: mask 0, whatever its advantage).

    >>> s0 = Step(context_ids=[1, 2], action_ids=[3, 4], action_logprobs=[-0.1, -0.2])
    >>> s1 = Step(context_ids=[1, 2, 3, 4, 9], action_ids=[5], action_logprobs=[-0.3])
    >>> r, = segment_rows(Episode(Task("t", "q", []), [s0, s1]), [1.0, -1.0])
    >>> r.ids, r.mask, r.adv
    ([1, 2, 3, 4, 9, 5], [0.0, 0.0, 1.0, 1.0, 0.0, 1.0], [0.0, 0.0, 1.0, 1.0, 0.0, -1.0])
    >>> s0.prefix = True
    >>> segment_rows(Episode(Task("t", "q", []), [s0, s1]), [1.0, -1.0])[0].mask
    [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    """
    rows, by_seg = [], {}  # by_seg: segment -> [(step index, step)]
    for i, s in enumerate(ep.steps):
        if s.action_ids:
            by_seg.setdefault(s.segment, []).append((i, s))
    for seg, idx in sorted(by_seg.items()):
        last = idx[-1][1]
        ids = list(last.context_ids) + list(last.action_ids)
        mask, adv, old = ([0.0] * len(ids) for _ in range(3))
        for i, s in idx:
            start = len(s.context_ids)
            if ids[start : start + len(s.action_ids)] != list(s.action_ids) or ids[:start] != list(s.context_ids):
                raise ValueError(f"episode {ep.task.id}: step {i} is not a prefix of its segment {seg}")
            for j, lp in enumerate(s.action_logprobs if not s.prefix else ()):
                mask[start + j] = weight
                adv[start + j] = step_adv[i]
                old[start + j] = lp
        rows.append(Row(ids, mask, adv, old))
    return rows


def training_rows(episodes: list[Episode], algo_cfg) -> list[Row]:
    """Scored episodes -> training rows: advantages by `algo.step_advantages` over the whole batch, shaped, and
    weighted by `algo.sample_weights` (a masked episode keeps its rows, with weight 0)."""
    own = [[s for s in ep.steps if not s.prefix] for ep in episodes]  # an expert prefix is context, not the policy's
    advs = algo.step_advantages([[s.reward for s in steps] for steps in own], [ep.group for ep in episodes],
                                algo_cfg.advantage, algo_cfg.gamma, algo_cfg.eps)
    advs = [[0.0] * ep.prefix_steps + a for ep, a in zip(episodes, advs)]
    advs = algo.shape_advantages(advs, algo_cfg.neg_adv_weight, algo_cfg.positive_only)
    weights = algo.sample_weights([ep.status == ENV_ERROR for ep in episodes], [ep.status != ANSWERED for ep in episodes],
                                  [ep.n_action_tokens for ep in episodes], mask_env_failures=algo_cfg.mask_env_failures,
                                  max_failed_tokens=algo_cfg.max_failed_tokens)
    return [row for ep, adv, w in zip(episodes, advs, weights) for row in segment_rows(ep, adv, 0 if ep.masked else w)]


def sft_rows(episodes: list[Episode]) -> list[Row]:
    """Expert episodes -> rows for `Learner.train_step(rows, sft=True)`: advantage 1 on every action token, so the
    DAPO loss is the mean negative log-likelihood of the actions.

    >>> r, = sft_rows([Episode(Task("t", "q", []), [Step([1, 2], [3, 4], [0.0, 0.0])])])
    >>> r.mask, r.adv
    ([0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0])
    """
    return [row for ep in episodes for row in segment_rows(ep, [1.0] * len(ep.steps))]
