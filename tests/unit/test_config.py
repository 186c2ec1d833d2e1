"""Config loading, overrides, validation errors and the generated reference page."""

from __future__ import annotations


import pytest

from reflow_hpc import config as C
from conftest import ROOT, python_m

BASE = """
[run]
name = "t"
[model]
warmstart = true
"""

# (TOML text, the key the one-line error must name)
MALFORMED = [
    ("!![run\nname = 'x'", "config"),                                        # TOML syntax error (raw file)
    ("[nonsense]\nx = 1", "[nonsense]"),                                      # unknown section
    ("[trainer]\nbatch = 8", "trainer.batch"),                                # unknown key
    ("[trainer]\nbatch_size = \"32\"", "trainer.batch_size"),                 # wrong type
    ("[trainer]\nlr = true", "trainer.lr"),                                   # bool is not a number
    ("[reflow]\nsigma = 1.0", "reflow.sigma"),                                # σ outside [0, 1)
    ("[reflow]\nsigma = -0.1", "reflow.sigma"),
    ("[trainer]\nbatch_size = -8", "trainer.batch_size"),                     # negative batch
    ("[resources]\nworkers = 0", "resources.workers"),                        # zero workers/nodes
    ("[resources]\nworkers = 6", "resources.workers"),                        # split does not add up
    ("!![model]\npath = \"/nonexistent/model\"", "model.path"),                # missing model
    ("[reflow]\nmode = \"turbo\"", "reflow.mode"),                            # not a choice
    ("[trainer]\nmicro_batch_size = 64\nbatch_size = 8", "trainer.micro_batch_size"),
    ("[reflow]\ntau = 0", "reflow.tau"),
    ("[reflow]\ndelta = 1.5", "reflow.delta"),                                # float for int
    ("[slurm]\nmpi = \"pmi3\"", "slurm.mpi"),
    ("!!trainer = 3\n[run]\nname = 't'", "trainer"),                          # a value where a section belongs
    ("[reflow]\nmode = \"fully_async\"\n[resources]\nworkers = 4\ntrainer_replicas = 0\nrollout_instances = 4",
     "resources.trainer_replicas"),
    ("[resources]\nworkers = 4\ntrainer_replicas = 2\nrollout_instances = 1\nrollout_tp_size = 2",
     "resources.rollout_tp_size"),                                            # one engine per worker on this build
    ("[reflow]\nmode = \"sync\"\nsigma = 0.0\n[resources]\nworkers = 3\ntrainer_replicas = 1\n"
     "trainer_shard_size = 2\nrollout_instances = 1", "resources.trainer_shard_size"),   # not whole replicas
    ("[resources]\nworkers = 6\ntrainer_replicas = 1\ntrainer_shard_size = 2\nrollout_instances = 4\n"
     "[scheduler]\nplacement_schedule = [\"3:3\"]", "scheduler.placement_schedule"),    # 3·2 = all workers
    ("[resources]\nworkers = 6\ntrainer_replicas = 1\ntrainer_shard_size = 2\nrollout_instances = 4\n"
     "[scheduler]\nmin_trainers = 2\nmin_rollouts = 3", "scheduler.min_trainers"),       # 2·2 + 3 > 6
]


@pytest.mark.parametrize("text,key", MALFORMED)
def test_malformed_config_one_line_exit_2(tmp_path, text, key):
    path = tmp_path / "bad.toml"
    # "!!" marks a file written as is; otherwise the case is appended to a valid base.
    path.write_text(text[2:] if text.startswith("!!") else BASE + "\n" + text)
    r = python_m("reflow_hpc.run", str(path), timeout=60)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"config error: {key}"), lines[0]
    assert "Traceback" not in r.stderr


def test_in_process_errors_name_key_value_and_allowed():
    with pytest.raises(C.ConfigError) as e:
        C.load(None, ["reflow.sigma=1.0", "model.warmstart=true"])
    assert str(e.value) == "config error: reflow.sigma = 1.0: must be ≥ 0 and < 1"
    with pytest.raises(C.ConfigError) as e:
        C.load(None, ["reflow.mode=turbo", "model.warmstart=true"])
    assert "allowed: sync, one_step_off, fully_async, reflow" in str(e.value)


def test_missing_config_file(tmp_path):
    r = python_m("reflow_hpc.run", str(tmp_path / "nope.toml"), timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("config error: config = ")


def test_set_overrides_and_resolved_toml_round_trip(tmp_path):
    r = python_m("reflow_hpc.config", str(ROOT / "configs" / "cpu_tiny.toml"),
                 "--set", "reflow.sigma=0.25", "--set", "run.name=override", timeout=60)
    assert r.returncode == 0, r.stderr
    assert 'sigma = 0.25' in r.stdout and 'name = "override"' in r.stdout
    resolved = tmp_path / "resolved.toml"
    resolved.write_text(r.stdout)
    again = C.load(resolved)
    assert C.to_dict(again) == C.to_dict(C.load(ROOT / "configs" / "cpu_tiny.toml",
                                                 ["reflow.sigma=0.25", "run.name=override"]))


def test_bad_override_syntax():
    r = python_m("reflow_hpc.config", "--set", "sigma=0.3", timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("config error: --set")


def test_every_key_documented_with_default():
    for sec_name, sec_cls in C.sections():
        for f in C.keys(sec_cls):
            assert f.metadata.get("doc"), f"{sec_name}.{f.name} has no documentation"


def test_reference_page_is_current():
    page = (ROOT / "docs" / "config.md").read_text()
    assert page == C.reference(), ("docs/config.md is stale: regenerate with "
                                   "`python -m reflow_hpc.config --reference > docs/config.md`")


def test_shipped_configs_load():
    for path in sorted((ROOT / "configs").glob("*.toml")):
        C.load(path, check_files=False)


def test_notices_name_a_reflow_delta_that_leaves_nothing_to_replay():
    at = lambda *sets: C.notices(C.load(ROOT / "configs" / "cpu_tiny.toml", list(sets), check_files=False))
    (line,) = at("reflow.delta=1")
    assert line.startswith("notice: reflow.delta = 1:") and "reflow.sigma = 0.5" in line
    assert at("reflow.delta=2") == [] and at("reflow.delta=1", "reflow.sigma=0") == []
    assert at("reflow.delta=1", "reflow.mode=fully_async", "reflow.sigma=0") == []


def test_the_run_prints_a_notice_once_before_it_starts_the_ranks():
    # --check skips the warm start; the missing launcher then ends the run before any rank starts.
    r = python_m("reflow_hpc.run", str(ROOT / "configs" / "cpu_tiny.toml"), "--check", "--set", "reflow.delta=1",
                 "--set", "run.mpiexec=no-such-mpiexec")
    assert r.returncode == 2, r.stderr
    assert [ln for ln in r.stderr.splitlines() if "notice:" in ln] == \
        [f"reflow_hpc: {C.notices(C.load(ROOT / 'configs' / 'cpu_tiny.toml', ['reflow.delta=1']))[0]}"]
    assert "run.mpiexec" in r.stderr


def test_shipped_configs_that_share_a_policy_warm_start_it_alike():
    """Two configs with one model.path must describe one warm start, or running one after the other
    is refused (warmstart.ensure_policy)."""
    from reflow_hpc.warmstart import recipe
    by_path: dict[str, tuple[str, dict]] = {}
    for path in sorted((ROOT / "configs").glob("*.toml")):
        cfg = C.load(path, check_files=False)
        if not cfg.model.warmstart:
            continue
        first = by_path.setdefault(cfg.model.path, (path.name, recipe(cfg)))
        assert first[1] == recipe(cfg), f"{path.name} and {first[0]} warm-start {cfg.model.path} differently"


def test_sharded_trainer_split_is_accepted():
    """n_T·s_T + n_R·s_R = W with s_T = 2: one replica sharded over two workers, two rollout workers."""
    cfg = C.load(None, ["resources.workers=4", "resources.trainer_replicas=1", "resources.trainer_shard_size=2",
                        "resources.rollout_instances=2"], check_files=False)
    assert cfg.resources.trainer_shard_size == 2


TP_SPLIT = ["resources.workers=4", "resources.trainer_replicas=2", "resources.rollout_instances=1",
            "resources.rollout_tp_size=2"]


def test_a_tensor_parallel_rollout_instance_is_accepted_with_vllm_in_every_mode():
    cfg = C.load(None, TP_SPLIT + ["rollout.engine=vllm", "reflow.mode=fully_async", "reflow.sigma=0"], check_files=False)
    assert cfg.resources.rollout_tp_size == 2
    cfg = C.load(None, TP_SPLIT + ["rollout.engine=vllm", "scheduler.elastic=false"], check_files=False)
    assert cfg.reflow.mode == "reflow"
    # Colocated: every block of two ranks trains and its first rank generates.
    cfg = C.load(None, TP_SPLIT + ["rollout.engine=vllm", "reflow.mode=sync", "reflow.sigma=0"], check_files=False)
    assert cfg.reflow.mode == "sync"
    # The elastic pool, and a schedule that moves whole instances: 4 + 1·2 -> 2 + 2·2 on 6 workers.
    six = ["resources.workers=6", "resources.trainer_replicas=4", "resources.rollout_instances=1",
           "resources.rollout_tp_size=2", "rollout.engine=vllm"]
    cfg = C.load(None, six, check_files=False)
    assert cfg.scheduler.elastic
    cfg = C.load(None, six + ['scheduler.placement_schedule=["2:2", "4:4"]', "scheduler.elastic=false"],
                 check_files=False)
    assert cfg.scheduler.placement_schedule == ["2:2", "4:4"]


def test_a_schedule_that_splits_an_instance_is_refused():
    with pytest.raises(C.ConfigError, match=r'scheduler.placement_schedule = "2:3": 3 trainer replicas .* whole '
                                            r"blocks of resources.rollout_tp_size \(2\)") as e:
        C.load(None, ["resources.workers=6", "resources.trainer_replicas=4", "resources.rollout_instances=1",
                      "resources.rollout_tp_size=2", "rollout.engine=vllm", 'scheduler.placement_schedule=["2:3"]'],
               check_files=False)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("sets, why", [
    (["reflow.mode=fully_async"], "runs one model per rank: tensor parallelism needs vllm"),
    (["rollout.engine=vllm", "scheduler.elastic=false", "resources.trainer_replicas=1", "resources.workers=3"],
     r"trainer ranks \(1·1\) must fill whole blocks of 2 ranks"),
    (["rollout.engine=vllm", "reflow.mode=sync", "reflow.sigma=0", "resources.trainer_replicas=1",
      "resources.workers=3"], r"resources.workers \(3\) must be a multiple of it"),
    (["rollout.engine=vllm", "scheduler.elastic=false", "resources.trainer_replicas=1", "resources.workers=5",
      "resources.rollout_instances=2"], r"trainer ranks \(1·1\) must fill whole blocks of 2 ranks"),
])
def test_a_tensor_parallel_rollout_instance_it_cannot_run_is_refused_naming_the_key(sets, why):
    with pytest.raises(C.ConfigError, match=r"resources.rollout_tp_size = 2: .*" + why):
        C.load(None, TP_SPLIT + sets, check_files=False)
