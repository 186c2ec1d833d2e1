"""Values that the submit path renders into a batch script or a path are refused at load, each with one
line naming the key: a newline would add a line to the script, a path in run.name would move the run
directory, a umask that lets others write would open the run's files to them."""

from __future__ import annotations

import pytest

from reflow_hpc import config as C


def _error(overrides: list[str]) -> C.ConfigError:
    with pytest.raises(C.ConfigError) as e:
        C.load(None, overrides, check_files=False)
    assert "\n" not in str(e.value), str(e.value)
    return e.value


@pytest.mark.parametrize("key", ["run.name", "slurm.partition", "slurm.account", "slurm.time", "slurm.mpi",
                                 "slurm.log_dir", "run.output_dir", "model.path", "storage.dir", "model.dtype"])
def test_a_newline_in_any_string_is_one_line_naming_the_key(key):
    e = _error([f'{key}="gpu\\n#SBATCH --uid=0"'])
    assert e.key == key and "control characters" in e.why
    assert str(e).startswith(f'config error: {key} = "gpu\\n#SBATCH --uid=0": ')


@pytest.mark.parametrize("char", ["\\r", "\\t", "\\u001b", "\\u007f", "\\u0085", "\\u2028"])
def test_other_control_characters_are_refused(char):
    e = _error([f'run.output_dir="runs{char}x"'])
    assert e.key == "run.output_dir"


def test_a_control_character_in_a_list_is_refused():
    e = _error(['run.plugins=["os\\nx"]'])
    assert e.key == "run.plugins"


def test_values_set_in_code_are_checked_too():
    cfg = C.load(None, check_files=False)
    cfg.slurm.account = "a\nb"
    with pytest.raises(C.ConfigError, match=r"^config error: slurm.account = \"a\\nb\""):
        C.validate(cfg, check_files=False)


@pytest.mark.parametrize("name", ["/etc", "..", "a/b", "../x", "x..y", ".hidden", "-x", "a b", "", "é"])
def test_run_name_must_be_a_plain_name(name):
    e = _error([f'run.name="{name}"'])
    assert e.key == "run.name" and "plain name" in e.why


@pytest.mark.parametrize("name", ["reflow", "cpu_tiny", "qwen3-8b.v2", "R2"])
def test_plain_run_names_load(name):
    assert C.load(None, [f"run.name={name}"], check_files=False).run.name == name


@pytest.mark.parametrize("key, value", [("slurm.partition", "gpu;id"), ("slurm.partition", "gpu --uid=0"),
                                        ("slurm.partition", "a,,b"), ("slurm.account", "acct,other"),
                                        ("slurm.account", "$(id)"), ("slurm.time", "1 hour"),
                                        ("slurm.time", "01:00:00 --uid=0"), ("slurm.mpi", "pmi2 --x")])
def test_slurm_values_must_be_plain(key, value):
    assert _error([f'{key}="{value}"']).key == key


def test_plain_slurm_values_load():
    cfg = C.load(None, ["slurm.partition=gpu,gpu-long", "slurm.account=proj_1.a", "slurm.time=1-02:00:00",
                        "slurm.mpi=pmix_v4"], check_files=False)
    assert (cfg.slurm.partition, cfg.slurm.account, cfg.slurm.mpi) == ("gpu,gpu-long", "proj_1.a", "pmix_v4")


@pytest.mark.parametrize("mask", ["000", "020", "775", "0770", "7", "77", "08", "1777", "0o077", "abc"])
def test_umask_must_be_octal_and_keep_others_from_writing(mask):
    assert _error([f'run.umask="{mask}"']).key == "run.umask"


@pytest.mark.parametrize("mask", ["077", "027", "022", "0027", "0777", "002"])
def test_private_umasks_load(mask):
    assert C.load(None, [f'run.umask="{mask}"'], check_files=False).run.umask == mask
