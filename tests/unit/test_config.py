"""Config validation: errors name the field and its flag; TOML and flags layer correctly."""

import argparse

import pytest

from p2p_diloco import config as cfg
from p2p_diloco import flags as flags_lib
from p2p_diloco.cli import build_parser
from p2p_diloco.errors import ConfigError

BASE = ["peer", "--run-id", "r1", "--island", "i0"]


def _peer(argv, config_file=""):
    args = build_parser().parse_args(argv)
    return flags_lib.build_config(cfg.PeerConfig, args, config_file or args.config)


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
        (["--outer-groups", "0"], "outer.groups (--outer-groups)"),
        # 30 s / (2 fragments x 3 groups) = 5 s between slots: less than 3 + 1.5 + 5 s of a round
        (["--outer-groups", "3"], "outer.period / (outer.fragments x outer.groups) = 5.00 s must exceed"),
        (["--outer-groups", "2", "--outer-period", "60", "--no-outer-nesterov"], "outer.groups > 1 needs the Nesterov"),
        (["--nproc-per-node", "0"], "nproc_per_node (--nproc-per-node)"),
        (["--island-parallel", "fsdp", "--checkpoint-dir", "ckpt"], "--checkpoint-dir is not supported with "
         "--island-parallel fsdp"),
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
    flags_lib.add_config_arguments(parser, cfg.PeerConfig)
    flags = {option for action in parser._actions for option in action.option_strings}
    for section in ("model", "data", "inner", "outer"):
        model = type(getattr(cfg.PeerConfig(run_id="r", island="i"), section))
        for name in model.model_fields:
            assert flags_lib.flag_for((section, name)) in flags


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


def test_sections_keep_the_flag_names_of_before():
    config = _peer(BASE + ["--checkpoint-dir", "ck", "--checkpoint-every", "9", "--checkpoint-keep", "2",
                           "--eval-every", "7", "--eval-batches", "3", "--progress-period", "1", "--progress-ttl", "4",
                           "--summary-json", "s.json", "--log-jsonl", "e.jsonl", "--tensorboard-dir", "tb"])
    assert (config.checkpoint.dir, config.checkpoint.every, config.checkpoint.keep) == ("ck", 9.0, 2)
    assert (config.eval.every, config.eval.batches, config.progress.period, config.progress.ttl) == (7.0, 3, 1.0, 4.0)
    assert (config.logging.summary_json, config.logging.log_jsonl, config.logging.tensorboard_dir) == \
        ("s.json", "e.jsonl", "tb")


def test_to_flags_rebuilds_the_same_configuration():
    config = _peer(BASE + ["--outer-period", "30.5", "--outer-max-delta", "0.1", "--no-outer-nesterov",
                           "--initial-peers", "/ip4/1.2.3.4/tcp/1/p2p/QmA", "/ip4/1.2.3.4/tcp/2/p2p/QmB",
                           "--summary-json", "s.json", "--eval-every", "3", "--inner-schedule", "cosine",
                           "--max-steps", "100", "--preset", "small"])
    flags = config.to_flags()
    assert "--summary-json" in flags and "--no-outer-nesterov" in flags and "--model-preset" in flags
    assert "--inner-lr" not in flags  # defaults are left out
    assert flags_lib.parse_flags(cfg.PeerConfig, flags) == config  # (without the subcommand)
    assert cfg.InnerConfig(lr=1e-3).to_flags(("inner",)) == ["--inner-lr", "0.001"]


def test_parse_flags_fails_in_the_launcher_naming_the_flag():
    with pytest.raises(ConfigError, match="unrecognized arguments: --outer-perod"):
        flags_lib.parse_flags(cfg.PeerConfig, BASE[1:] + ["--outer-perod", "8"])
    with pytest.raises(ConfigError, match=r"invalid outer.period \(--outer-period\)"):
        flags_lib.parse_flags(cfg.PeerConfig, BASE[1:] + ["--outer-period", "-8"])
    with pytest.raises(ConfigError, match="unrecognized"):  # no abbreviations: a renamed flag is not guessed
        flags_lib.parse_flags(cfg.PeerConfig, BASE[1:] + ["--outer-per", "8"])


def test_faults_are_lab_flags_the_product_refuses():
    from p2p_diloco.lab.faults import LabPeerConfig

    faulty = flags_lib.parse_flags(LabPeerConfig, BASE[1:] + ["--slowdown", "2", "--debug-corrupt-outer", "nan"])
    assert faulty.debug.slowdown == 2.0 and faulty.debug.any and not flags_lib.parse_flags(LabPeerConfig, BASE[1:]).debug.any
    for flag in (["--slowdown", "2"], ["--debug-corrupt-outer", "nan"], ["--debug-donate-delay", "1"]):
        with pytest.raises(ConfigError, match="unrecognized"):
            flags_lib.parse_flags(cfg.PeerConfig, BASE[1:] + flag)
    with pytest.raises(ConfigError, match="corrupt_on_signal needs"):
        flags_lib.parse_flags(LabPeerConfig, BASE[1:] + ["--debug-corrupt-on-signal"])
