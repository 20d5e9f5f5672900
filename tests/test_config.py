import pytest

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


def test_every_shipped_config_file_loads():
    from pathlib import Path

    files = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
    assert files, "configs/ has no yaml files"
    for f in files:
        resolve(config_file=f)


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
