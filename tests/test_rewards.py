
import pytest

from l0_min.config import ConfigError, RewardConfig
from l0_min.episode import Episode, Step, Task
from l0_min.answers import answer_reward, exact_match, f1_score, has_answer, normalize_answer, token_f1
from l0_min.rewards import format_ok, score_episode


@pytest.mark.parametrize("raw, norm", [
    ("The Beatles", "beatles"),
    ("  A  Tale of Two Cities ", "tale of two cities"),
    ("an apple", "apple"),
    ("theatre", "theatre"),  # an article only as a whole word
    ("U.S.A.", "usa"),  # SQuAD: punctuation removed without a space
    ("1,000", "1000"),
    ("$5.00", "500"),
    ("3-4 km", "34 km"),
    ("Café", "café"),  # accents kept (L0's ASCII normaliser drops them)
    ("Cafe\u0301", "café"),  # decomposed accent == composed (NFKC)
    ("Müller-Lüdenscheidt", "müllerlüdenscheidt"),
    ("l'Hôpital", "lhôpital"),
    ("¿Qué?", "qué"),
    ("«Tokyo»", "tokyo"),  # non-ASCII punctuation removed
    ("Ｔｏｋｙｏ", "tokyo"),  # full width folds
    ("東京都", "東京都"),
    ("Straße", "strasse"),  # casefold
    ("100 km²", "100 km2"),
    ("🙂 ok", "ok"),  # symbols removed
    ("", ""),
    ("— ... —", ""),
])
def test_normalize(raw, norm):
    assert normalize_answer(raw) == norm


def test_normalize_rejects_non_strings():
    with pytest.raises(TypeError, match="expects a str"):
        normalize_answer(12)


def test_exact_match_cases():
    assert exact_match("yes", ["Yes"]) == 1.0
    assert exact_match("no", ["yes"]) == 0.0
    assert exact_match("12", ["12 km"]) == 0.0  # units matter for EM
    assert exact_match("July 4, 1776", ["4 July 1776"]) == 0.0
    assert exact_match("cafe", ["Café"]) == 0.0  # no accent stripping
    assert exact_match("CAFÉ!", ["Café"]) == 1.0
    assert exact_match("the U.S.", ["US"]) == 1.0
    assert exact_match("Lyon", ["Paris", "Lutetia", "lyon"]) == 1.0  # any alias
    assert exact_match("Paris", "Paris") == 1.0  # a single gold string
    assert exact_match("", ["Paris"]) == 0.0
    assert exact_match("   ", [""]) == 0.0
    assert exact_match(None, ["Paris"]) == 0.0
    assert exact_match("A+", ["A+", "AB+"]) == 1.0  # gold of only punctuation/articles: light match
    assert exact_match("+", ["A+"]) == 0.0
    assert exact_match("B+", ["A+"]) == 0.0
    with pytest.raises(ValueError, match="no gold"):
        exact_match("x", [])


def test_f1_exact_numbers():
    assert f1_score("the cat sat", ["cat sat on mat"]) == pytest.approx(2 * 1.0 * 0.5 / 1.5, abs=1e-15)
    assert f1_score("12", ["12 km"]) == pytest.approx(2 / 3, abs=1e-15)
    assert f1_score("July 4, 1776", ["4 July 1776"]) == 1.0  # same bag of tokens
    assert f1_score("Barack Obama", ["Obama"]) == pytest.approx(2 / 3, abs=1e-15)
    assert f1_score("w x y z", ["y z q"]) == pytest.approx(2 * 0.5 * (2 / 3) / (0.5 + 2 / 3), abs=1e-15)
    assert f1_score("a b c d", ["c d e"]) == pytest.approx(2 / 3, abs=1e-15)  # "a" is an article: b c d
    assert f1_score("cafe", ["café"]) == 0.0
    assert f1_score("", ["Paris"]) == 0.0
    assert f1_score("A+", ["A+"]) == 1.0 and f1_score("AB+", ["A+"]) == 0.0


def test_f1_hotpot_yes_no_special_case():
    assert f1_score("yes", ["yes it is"]) == 0.0  # prediction special and different
    assert f1_score("yes it is", ["yes"]) == 0.0  # gold special and different
    assert f1_score("no", ["No."]) == 1.0
    assert f1_score("noanswer", ["no answer"]) == 0.0
    assert f1_score("maybe no", ["no way"]) == 0.5


def test_token_f1_on_normalised_text():
    assert token_f1("barack obama", "obama") == pytest.approx(2 / 3, abs=1e-15)
    assert token_f1("", "") == 0.0 and token_f1("yes", "yes") == 1.0 and token_f1("no", "no way") == 0.0


def test_f1_best_over_aliases():
    assert f1_score("president Barack Obama", ["Obama", "Barack Obama"]) == 0.8
    assert f1_score("Obama", ["Obama", "Barack Obama"]) == 1.0
    assert f1_score(None, ["x"]) == 0.0


def test_has_answer_and_answer_reward():
    assert has_answer("0") and not has_answer("") and not has_answer(" \n") and not has_answer(None)
    # issue 13: punctuation alone is not an answer (and earns no has_answer reward); a word with it is
    assert not has_answer("|") and not has_answer(" ... ") and not has_answer("—") and has_answer("A+") and has_answer("東京")
    em = lambda pred: exact_match(pred, ["Paris"])
    assert answer_reward("|", em("|")) == 0.0 and f1_score("|", ["|"]) == 0.0
    assert answer_reward("paris", em("paris")) == 1.0
    assert answer_reward("Lyon", em("Lyon")) == 0.1
    assert answer_reward("", em("")) == 0.0
    assert answer_reward(None, em(None)) == 0.0
    assert answer_reward("Lyon", 0.5) == pytest.approx(0.55, abs=1e-15)
    assert answer_reward("Paris", 1.0, em_weight=1.0, has_answer_weight=0.0) == 1.0


@pytest.mark.parametrize("text, ok", [
    ("<think>search for it first</think><code>print(1+1)</code>", True),
    ("<think>search for it first</think>\n<code>print(1+1)", True),  # stop string stripped
    ("<think>0123456789</think><code>print(1)</code>", False),  # 10 chars: not more than 10
    ("<think>0123456789a</think><code>print(1)</code>", True),  # 11 chars
    ("<think>search for it first</think><code>a=1+2</code>", False),  # 5 chars
    ("<think>search for it first</think><code>a=1+23</code>", True),  # 6 chars
    ("<think>search for it first</think><code>   </code>", False),
    ("<code>print(1+1)</code>", False),
    ("<think>search for it first</think>", False),
    ("<think>search for it first</think><think>and more thinking</think><code>print(1)</code>", False),
    ("<think>search for it first</think><code>print(1)</code><code>print(2)</code>", False),
    ("<code>print(1+1)</code><think>search for it first</think>", False),
    ("<think>search for it first<code>print(1+1)</code>", False),
    ("", False),
])
def test_format_ok(text, ok):
    assert format_ok(text) is ok


def test_format_ok_thresholds():
    text = "<think>abc</think><code>x</code>"
    assert format_ok(text, min_think_chars=2, min_code_chars=0)
    assert not format_ok(text, min_think_chars=3, min_code_chars=0)


@pytest.mark.parametrize("oks, score", [([True, False, None, True, True], 0.75), ([False], 0.0), ([None, None], 0.0),
                                        ([], 0.0)])
def test_exec_score_is_the_share_of_the_steps_that_ran_code_without_an_error(oks, score):
    ep = Episode(Task("t", "q", ["a"]), [Step([], [], [], exec_ok=ok) for ok in oks])
    score_episode(ep, RewardConfig(), _qa(RewardConfig()))
    assert ep.rewards["exec"] == score


GOOD = "<think>I should search the corpus.</think><code>web_search('Paris')</code>"
BAD = "I will just answer."


def _qa(reward_cfg, **settings):
    from l0_min.config import Config
    from l0_min.envs.qa import QA

    return QA(Config(reward=reward_cfg, envs={"qa": settings}))


def _episode(answer, steps):
    ep = Episode(Task("t1", "What is the capital of France?", ["Paris"]))
    ep.final_answer = answer
    ep.steps = [Step([], [], [], action_text=text, exec_ok=ok) for text, ok in steps]
    return ep


def test_score_episode_worked_example():
    ep = _episode("paris", [(GOOD, True), (BAD, False), (GOOD, None), (GOOD, True)])
    score_episode(ep, RewardConfig(), _qa(RewardConfig()))
    per_step = [s.reward for s in ep.steps]
    assert per_step == pytest.approx([0.1 / 4 + 0.1 / 3, 0.0, 0.1 / 4, 0.1 / 4 + 0.1 / 3 + 0.8], abs=1e-12)
    assert [s.format_ok for s in ep.steps] == [True, False, True, True]
    assert ep.reward == pytest.approx(0.8 * 1.0 + 0.1 * 0.75 + 0.1 * 2 / 3, abs=1e-12)
    assert ep.reward == pytest.approx(0.941666666666667, abs=1e-12)
    assert sum(per_step) == pytest.approx(ep.reward, abs=1e-12)
    assert ep.rewards == pytest.approx({"core": 1.0, "format": 0.75, "exec": 2 / 3, "em": 1.0, "f1": 1.0,
                                        "has_answer": 1.0, "official_em": 1.0, "official_f1": 1.0, "total": ep.reward},
                                       abs=1e-12)


def test_score_episode_wrong_answer_and_no_answer():
    ep = _episode("Lyon", [(GOOD, True), (GOOD, False)])
    score_episode(ep, RewardConfig(), _qa(RewardConfig()))
    # answer = 0.1 (answered, wrong); format 1; exec 0.5
    assert ep.reward == pytest.approx(0.8 * 0.1 + 0.1 * 1.0 + 0.1 * 0.5, abs=1e-12)
    assert [s.reward for s in ep.steps] == pytest.approx([0.05 + 0.05, 0.05 + 0.0 + 0.08], abs=1e-12)
    assert ep.rewards["em"] == 0.0 and ep.rewards["has_answer"] == 1.0

    ep = _episode(None, [(BAD, None)])
    score_episode(ep, RewardConfig(), _qa(RewardConfig()))
    assert ep.reward == 0.0 and ep.steps[0].reward == 0.0
    assert ep.rewards["has_answer"] == 0.0 and ep.rewards["exec"] == 0.0


def test_score_episode_without_steps():
    ep = _episode("Paris", [])
    score_episode(ep, RewardConfig(), _qa(RewardConfig()))
    assert ep.reward == pytest.approx(0.8, abs=1e-12)
    assert ep.rewards["format"] == 0.0 and ep.rewards["exec"] == 0.0


def test_score_episode_uses_config_weights_and_metric():
    cfg = RewardConfig(answer_weight=1.0, format_weight=0.0, exec_weight=0.0, em_weight=1.0, has_answer_weight=0.0)
    ep = _episode("president Barack Obama", [(GOOD, True)])
    ep.task.answers = ["Barack Obama"]
    score_episode(ep, cfg, _qa(cfg, answer_metric="f1"))
    assert ep.reward == pytest.approx(0.8, abs=1e-12)  # F1 = 0.8
    assert ep.rewards["em"] == 0.0 and ep.rewards["f1"] == pytest.approx(0.8, abs=1e-12)

    cfg = RewardConfig(min_think_chars=100)
    ep = _episode("Paris", [(GOOD, True)])
    score_episode(ep, cfg, _qa(cfg))
    assert ep.steps[0].format_ok is False and ep.rewards["format"] == 0.0

    with pytest.raises(ValueError, match="envs.qa.answer_metric must be 'em' or 'f1', got 'bleu'"):
        _qa(RewardConfig(), answer_metric="bleu")
    with pytest.raises(ConfigError, match=r"unknown key 'envs.qa.metric' \(envs.qa has: entities, answer_metric\)"):
        _qa(RewardConfig(), metric="f1")


def test_an_action_cut_off_by_the_token_limit_is_not_well_formed_in_the_reward_either():
    """One format rule (rewards.format_ok, applied once, in score_episode): `<think>...</think><code>print(123` cut
    off by the token limit (finish_reason "length") is malformed; stopped at </code> (trimmed) it is fine."""
    cut = "<think>print a number for the task</think><code>print(123"
    ep = _episode(None, [(cut, None)])
    ep.steps[0].finish_reason = "length"
    score_episode(ep, RewardConfig(), _qa(RewardConfig()))
    assert ep.steps[0].format_ok is False and ep.rewards["format"] == 0.0
    ep.steps[0].finish_reason = "stop"
    score_episode(ep, RewardConfig(), _qa(RewardConfig()))
    assert ep.steps[0].format_ok is True and ep.rewards["format"] == 1.0


# ---- step rewards (reward.step_weight x TaskEnv.step_rewards)
class _Stepped:
    """An environment with step rewards of its own: core 1 for "Paris", `parts` one per step."""

    name = "stepped"

    def __init__(self, parts):
        self.parts, self.called = parts, 0

    def score(self, ep):
        return {"core": float((ep.final_answer or "").lower() == "paris")}

    def step_rewards(self, ep):
        self.called += 1
        return self.parts


def test_step_rewards_are_added_to_each_step_and_to_the_total_under_their_weight():
    """Step i gets step_weight * parts[i] beside its format / exec terms, the last the answer; the total is their sum
    and ep.rewards["step"] the unweighted sum. An expert prefix's part is dropped with its other terms."""
    cfg = RewardConfig(step_weight=0.4)
    ep = _episode("Paris", [(GOOD, True), (GOOD, True), (GOOD, True)])
    score_episode(ep, cfg, _Stepped([0.5, -0.1, 0.25]))
    fe = 0.1 / 3 + 0.1 / 3  # each step's format and exec terms
    assert [s.reward for s in ep.steps] == pytest.approx([fe + 0.2, fe - 0.04, fe + 0.1 + 0.8], abs=1e-12)
    assert ep.reward == pytest.approx(0.8 + 0.1 + 0.1 + 0.4 * 0.65, abs=1e-12) == sum(s.reward for s in ep.steps)
    assert ep.rewards["step"] == pytest.approx(0.65, abs=1e-12) and ep.rewards["total"] == ep.reward
    ep.steps[0].prefix = True  # rollout.resample: the expert's step earns nothing, its part included
    score_episode(ep, cfg, _Stepped([0.5, -0.1, 0.25]))
    assert [s.reward for s in ep.steps] == pytest.approx([0.0, 0.05 + 0.05 - 0.04, 0.05 + 0.05 + 0.1 + 0.8], abs=1e-12)
    assert ep.rewards["step"] == pytest.approx(0.15, abs=1e-12)


def test_step_weight_zero_leaves_every_reward_exactly_as_before_and_never_asks_the_environment():
    """The default (step_weight 0): bit-for-bit the rewards of the formula without step rewards, no "step" metric,
    and step_rewards() is not called (a broken one cannot touch a run that does not use it)."""
    ep = _episode("paris", [(GOOD, True), (BAD, False), (GOOD, None), (GOOD, True)])
    env = _Stepped([float("nan")])
    score_episode(ep, RewardConfig(), env)
    assert env.called == 0 and "step" not in ep.rewards
    assert [s.reward for s in ep.steps] == [0.1 * 1.0 / 4 + 0.1 * 1.0 / 3, 0.1 * 0.0 / 4 + 0.1 * 0.0 / 3, 0.1 * 1.0 / 4,
                                            0.1 * 1.0 / 4 + 0.1 * 1.0 / 3 + 0.8 * 1.0]  # == : exactly, not approx
    assert ep.reward == 0.8 * 1.0 + 0.1 * 0.75 + 0.1 * (2 / 3)


@pytest.mark.parametrize("parts, why", [([0.1, 0.2], "returned [0.1, 0.2]"), ([0.1, float("nan"), 0.0], "nan"),
                                        ([0.1, float("inf"), 0.0], "inf"), ((0.0, "1", 0.0), "'1'"),
                                        ([True, 0.0, 0.0], "True"), (None, "None")])
def test_a_wrong_length_or_a_non_finite_step_reward_is_one_line_naming_the_environment_and_task(parts, why):
    ep = _episode("Paris", [(GOOD, True)] * 3)
    with pytest.raises(ValueError) as e:
        score_episode(ep, RewardConfig(step_weight=0.4), _Stepped(parts))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("env 'stepped': step_rewards() of task 't1' returned ") and why in msg
    assert msg.endswith("expected a list of 3 finite numbers, one per step")


def test_the_protocol_default_is_no_step_rewards(tmp_path, monkeypatch):
    """load_env gives an environment without step_rewards the default (zeros, one per step), as TaskEnvBase has it;
    an object without the part at all (collect's placeholder environment) scores zeros too."""
    from types import SimpleNamespace

    from l0_min.config import Config
    from l0_min.envs import TaskEnvBase, load_env

    (tmp_path / "bare_env.py").write_text(
        "class Env:\n    metrics, tools, system_prompt, worked_example = ('correct',), (), '', ()\n"
        "    def tasks(self, source, limit=None): return []\n    def prompt(self, task): return ''\n"
        "    def files(self, task): return {}\n    def expert(self, task): return None\n"
        "    def corpus(self, tasks): return []\n    def score(self, ep): return {'core': 1.0, 'correct': 1.0}\n"
        "def make_env(cfg): return Env()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ep = _episode("x", [(GOOD, True)] * 2)
    assert TaskEnvBase().step_rewards(ep) == [0.0, 0.0]
    env = load_env("bare_env", Config())
    assert env.step_rewards(ep) == [0.0, 0.0]
    score_episode(ep, RewardConfig(step_weight=0.4), env)
    assert ep.rewards["step"] == 0.0 and ep.reward == pytest.approx(1.0, abs=1e-12)
    score_episode(ep, RewardConfig(step_weight=0.4), SimpleNamespace(name="n", score=lambda ep: {"core": 0.0}))
    assert ep.rewards["step"] == 0.0
