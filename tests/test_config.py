import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from l0_min.config import Config, ConfigError, resolve, save


def test_defaults_file_then_overrides(tmp_path):
    f = tmp_path / "x.yaml"
    f.write_text("algo:\n  gamma: 0.5\n  kl_coef: 0.001\nrollout:\n  n_samples: 2\n")
    cfg = resolve(["algo.gamma=0.9", "inference.urls=[http://a:1,http://b:2]"], config_file=f)
    assert cfg.algo.gamma == 0.9 and cfg.algo.kl_coef == 0.001 and cfg.rollout.n_samples == 2
    assert cfg.inference.urls == ["http://a:1", "http://b:2"]
    assert cfg.learner.lr == Config().learner.lr


def test_unknown_key_and_wrong_type_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="unknown key 'rollout.nsamples'"):
        resolve(["rollout.nsamples=2"])
    with pytest.raises(ConfigError, match="rollout.n_samples: expected int"):
        resolve(["rollout.n_samples=two"])
    with pytest.raises(ConfigError, match="sandbox.network: expected bool"):
        resolve(["sandbox.network=3"])
    with pytest.raises(ConfigError, match="unknown key 'nosuch'"):
        resolve(["nosuch.x=1"])
    f = tmp_path / "bad.yaml"
    f.write_text("algo:\n  gamma: [1]\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: algo.gamma: expected float"):
        resolve(config_file=f)
    with pytest.raises(ConfigError, match="config file not found"):
        resolve(config_file=tmp_path / "missing.yaml")
    f.write_text("algo: [\n")
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML"):
        resolve(config_file=f)
    f.write_text("- 1\n")
    with pytest.raises(ConfigError, match="bad.yaml: top level must be a mapping"):
        resolve(config_file=f)
    with pytest.raises(ConfigError, match="not of the form"):
        resolve(["algo.gamma"])


def test_resolved_config_round_trips(tmp_path):
    cfg = resolve(["algo.advantage=grpo", "learner.betas=[0.9,0.95]", "run.steps=3"])
    save(cfg, tmp_path / "config.yaml")
    assert resolve(config_file=tmp_path / "config.yaml") == cfg


def test_an_environment_s_settings_merge_and_round_trip(tmp_path):
    """Issue 37: settings of one environment live under envs.<name> (QA's: envs.qa.entities, answer_metric), not in
    shared sections; a file and overrides merge key by key, the environment checks them (test_rewards.py)."""
    f = tmp_path / "x.yaml"
    f.write_text("envs:\n  qa: {entities: 160}\n  letters: {alphabet: abc}\n")
    cfg = resolve(["envs.qa.answer_metric=f1", "envs.math.x=1"], config_file=f)
    assert cfg.envs == {"qa": {"entities": 160, "answer_metric": "f1"}, "letters": {"alphabet": "abc"}, "math": {"x": 1}}
    save(cfg, tmp_path / "config.yaml")
    assert resolve(config_file=tmp_path / "config.yaml") == cfg
    with pytest.raises(ConfigError, match="envs.qa: expected a mapping of that environment's settings, got 3"):
        resolve(["envs.qa=3"])
    with pytest.raises(ConfigError, match="unknown key 'data.synthetic_entities'"):
        resolve(["data.synthetic_entities=160"])  # moved to envs.qa.entities
    assert Config().envs == {} and Config().envs is not Config().envs


# ---------------------------------------------------------------- shipped configs, and configs as deltas (base:)
ROOT = Path(__file__).resolve().parents[1]
PINNED = ROOT / "tests" / "fixtures" / "configs_resolved.json"
NOTE = ("every shipped config's resolved tree, pinned (tests/test_config.py); after changing a config on purpose: "
        ".venv/bin/python -m tests.test_config, then review the diff")


def shipped() -> dict:
    """{name: resolved tree} of configs/*.yaml, as JSON would hold it."""
    return {p.stem: dataclasses.asdict(resolve(config_file=p)) for p in sorted((ROOT / "configs").glob("*.yaml"))}


def test_every_shipped_config_resolves_to_its_pinned_values():
    """Issue 43: the configs became deltas of each other (base:) without one value changing. The fixture is the
    resolved tree of each config before that change; it changes only deliberately: regenerate it (NOTE) when a
    config's value is changed on purpose. The JSON text is compared too, so 1 vs 1.0 or true vs 1 also fails."""
    pinned = json.loads(PINNED.read_text())
    assert pinned.pop("//") == NOTE
    now = shipped()
    assert sorted(now) == sorted(pinned), "a config was added or removed: regenerate the fixture (see its '//')"
    for name in now:
        assert now[name] == pinned[name], name
        assert json.dumps(now[name], sort_keys=True) == json.dumps(pinned[name], sort_keys=True), name


def test_a_base_chain_resolves_root_first_and_overrides_win(tmp_path):
    """defaults < base's base < base < the file < overrides; `base:` is relative to the file that names it."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "root.yaml").write_text("run: {steps: 1, seed: 1, save_every: 1}\nlearner: {lr: 1.0e-3}\n"
                                        "envs: {qa: {entities: 40}}\n")
    (tmp_path / "sub" / "mid.yaml").write_text("base: ../root.yaml\nrun: {steps: 2, seed: 2}\nalgo: {gamma: 0.5}\n")
    (tmp_path / "leaf.yaml").write_text("base: sub/mid.yaml\nrun: {steps: 3}\nenvs: {qa: {answer_metric: f1}}\n")
    cfg = resolve(config_file=tmp_path / "leaf.yaml")
    assert (cfg.run.steps, cfg.run.seed, cfg.run.save_every) == (3, 2, 1)  # each level overrides the one before
    assert cfg.learner.lr == 1e-3 and cfg.algo.gamma == 0.5 and cfg.rollout.n_samples == Config().rollout.n_samples
    assert cfg.envs == {"qa": {"entities": 40, "answer_metric": "f1"}}  # an environment's settings merge by key
    cfg = resolve(["run.steps=4", "run.seed=5"], config_file=tmp_path / "leaf.yaml")
    assert (cfg.run.steps, cfg.run.seed, cfg.run.save_every) == (4, 5, 1)
    # the saved tree is the resolved one, without `base`, and reads back to the same tree (--resume)
    save(cfg, tmp_path / "config.yaml")
    assert "base" not in yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert resolve(config_file=tmp_path / "config.yaml") == cfg
    with pytest.raises(ConfigError, match="unknown key 'base'"):
        resolve(["base=root.yaml"])  # a base is a file's, not a command line's


def _one_line(config_file) -> str:
    with pytest.raises(ConfigError) as e:
        resolve(config_file=config_file)
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


def test_a_bad_base_is_one_line_naming_the_files(tmp_path):
    a, b, c = (tmp_path / f"{n}.yaml" for n in "abc")
    a.write_text("base: nowhere.yaml\n")
    assert _one_line(a) == f"config file not found: {tmp_path / 'nowhere.yaml'} (the base of {a})"
    a.write_text("base: b.yaml\nrun: {steps: 3}\n")
    b.write_text("base: ./a.yaml\n")
    assert _one_line(a) == f"config base cycle: {a} -> {b} -> {a}"
    a.write_text("base: a.yaml\n")
    assert _one_line(a) == f"config base cycle: {a} -> {a}"
    a.write_text("base: b.yaml\n")
    b.write_text(f"base: ../{tmp_path.name}/c.yaml\n")  # the same file by another path is still a cycle
    c.write_text("base: b.yaml\n")
    c2 = tmp_path / ".." / tmp_path.name / "c.yaml"
    assert _one_line(a) == f"config base cycle: {a} -> {b} -> {c2} -> {c2.parent / 'b.yaml'}"
    for bad in ("[b.yaml]", "3", "null", "{x: 1}"):
        a.write_text(f"base: {bad}\n")
        assert _one_line(a).startswith(f"{a}: base: expected a path relative to this file, got ")
    a.write_text("base: b.yaml\n")
    b.write_text("algo: {gamma: [1]}\n")
    assert _one_line(a).startswith(f"{b}: algo.gamma: expected float")  # an error in a base names the base


if __name__ == "__main__":  # regenerate the pinned fixture: only when a shipped config changed on purpose
    PINNED.write_text(json.dumps({"//": NOTE, **shipped()}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {PINNED.relative_to(ROOT)}: review `git diff {PINNED.relative_to(ROOT)}` before committing")
