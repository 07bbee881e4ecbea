"""Config validation: errors name the field and its flag; TOML and flags layer correctly."""

import argparse

import pytest

from p2p_diloco import config as cfg
from p2p_diloco.cli import build_parser
from p2p_diloco.errors import ConfigError

BASE = ["peer", "--run-id", "r1", "--island", "i0"]


def _peer(argv, config_file=""):
    args = build_parser().parse_args(argv)
    return cfg.build_config(cfg.PeerConfig, args, config_file or args.config)


def test_defaults_and_aliases():
    config = _peer(BASE + ["--preset", "small", "--data", "x.txt", "--outer-period", "40"])
    assert config.model.preset == "small" and config.data.path == "x.txt"
    assert config.outer.period == 40.0 and config.outer.fragments == 2 and config.outer.lr == 0.7


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--inner-lr", "-1"], "inner.lr (--inner-lr)"),
        (["--outer-momentum", "1.5"], "outer.momentum (--outer-momentum)"),
        (["--outer-fragments", "0"], "outer.fragments (--outer-fragments)"),
        (["--max-steps", "many"], "max_steps (--max-steps)"),
        (["--island", "bad name!"], "island (--island)"),
        (["--outer-period", "2"], "outer.period"),
    ],
)
def test_invalid_values_name_the_field(flags, expected):
    with pytest.raises(ConfigError) as error:
        _peer(BASE + flags)
    assert expected in str(error.value)


def test_missing_run_id_is_named():
    with pytest.raises(ConfigError, match=r"run_id \(--run-id\): is required"):
        _peer(["peer", "--island", "i0"])


def test_toml_then_flags(tmp_path):
    file = tmp_path / "c.toml"
    file.write_text('device = "cpu"\n[outer]\nperiod = 50.0\nfragments = 3\n[inner]\nlr = 0.01\n')
    config = _peer(BASE + ["--config", str(file), "--outer-fragments", "4"])
    assert config.device == "cpu" and config.outer.period == 50.0 and config.inner.lr == 0.01
    assert config.outer.fragments == 4  # the flag wins


def test_toml_unknown_key_and_bad_file(tmp_path):
    file = tmp_path / "c.toml"
    file.write_text("[outer]\nperiodd = 5\n")
    with pytest.raises(ConfigError, match=r"outer\.periodd"):
        _peer(BASE + ["--config", str(file)])
    file.write_text("[outer\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        _peer(BASE + ["--config", str(file)])
    with pytest.raises(ConfigError, match="does not exist"):
        _peer(BASE + ["--config", str(tmp_path / "missing.toml")])


def test_example_configs_are_valid():
    from tests.conftest import ROOT

    for file in sorted((ROOT / "peers").glob("*.toml")):
        _peer(BASE + ["--config", str(file)])


def test_choices_are_checked_by_argparse(capsys):
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(BASE + ["--preset", "huge"])
    assert exited.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_every_field_has_a_flag():
    parser = argparse.ArgumentParser()
    cfg.add_config_arguments(parser, cfg.PeerConfig)
    flags = {option for action in parser._actions for option in action.option_strings}
    for section in ("model", "data", "inner", "outer"):
        model = type(getattr(cfg.PeerConfig(run_id="r", island="i"), section))
        for name in model.model_fields:
            assert cfg.flag_for((section, name)) in flags


def test_codec_and_merge_choices_are_checked():
    from p2p_diloco.config import OuterConfig

    assert OuterConfig().codec == "none" and OuterConfig().merge == "mean"
    assert OuterConfig(codec="int4", merge="rda").codec == "int4"
    with pytest.raises(Exception, match="codec"):
        OuterConfig(codec="int3")
    with pytest.raises(Exception, match="merge"):
        OuterConfig(merge="median")


def test_cosine_schedule_takes_its_horizon_from_max_steps_or_needs_one():
    config = _peer(BASE + ["--inner-schedule", "cosine", "--max-steps", "300"])
    assert config.inner.decay_steps == 300
    config = _peer(BASE + ["--inner-schedule", "cosine", "--inner-decay-steps", "80", "--max-steps", "300"])
    assert config.inner.decay_steps == 80
    with pytest.raises(ConfigError, match="--inner-decay-steps or --max-steps"):
        _peer(BASE + ["--inner-schedule", "cosine"])


def test_cosine_schedule_must_outlast_the_warm_up_and_leaves_the_callers_inner_config_alone():
    with pytest.raises(ConfigError, match="warm-up"):
        _peer(BASE + ["--inner-schedule", "cosine", "--max-steps", "30", "--inner-warmup-steps", "50"])
    inner = cfg.InnerConfig(schedule="cosine", warmup_steps=10)
    assert cfg.PeerConfig(run_id="r", island="i", max_steps=300, inner=inner).inner.decay_steps == 300
    assert inner.decay_steps == 0
    assert cfg.PeerConfig(run_id="r", island="i", max_steps=50, inner=inner).inner.decay_steps == 50
