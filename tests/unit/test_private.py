"""reflow_hpc/private.py: writes that cannot be redirected, private directories, private scratch."""

from __future__ import annotations

import os
import stat

import pytest

from reflow_hpc import private
from reflow_hpc.private import UnsafePathError

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="a file owned by another uid can only be made as root")


@pytest.fixture
def umask077():
    old = os.umask(0o077)
    yield
    os.umask(old)


def one_line(err: pytest.ExceptionInfo, path) -> str:
    text = str(err.value)
    assert "\n" not in text and str(path) in text, text
    return text


# -- private_dir --------------------------------------------------------------------------------


def test_private_dir_creates_parents_0700(tmp_path, umask077):
    d = private.private_dir(tmp_path / "a" / "b" / "run", what="run directory")
    for p in (tmp_path / "a", tmp_path / "a" / "b", d):
        assert stat.S_IMODE(os.lstat(p).st_mode) == 0o700
    assert private.private_dir(d, what="run directory") == d      # an existing private one is accepted


def test_private_dir_umask_only_narrows(tmp_path):
    old = os.umask(0o000)       # even a permissive umask leaves the directory 0700
    try:
        d = private.private_dir(tmp_path / "x", what="run directory")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.lstat(d).st_mode) == 0o700


def test_private_dir_refuses_other_writable(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    d.chmod(0o777)
    with pytest.raises(UnsafePathError) as err:
        private.private_dir(d, what="run directory")
    assert "writable by group or others" in one_line(err, d) and "run directory" in str(err.value)


def test_private_dir_refuses_group_writable(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    d.chmod(0o770)
    with pytest.raises(UnsafePathError):
        private.private_dir(d, what="run directory")


def test_private_dir_refuses_symlink(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "run").symlink_to(target)
    with pytest.raises(UnsafePathError) as err:
        private.private_dir(tmp_path / "run", what="run directory")
    assert "symlink" in one_line(err, tmp_path / "run")


def test_private_dir_refuses_a_file(tmp_path):
    (tmp_path / "run").write_text("x")
    with pytest.raises(UnsafePathError) as err:
        private.private_dir(tmp_path / "run", what="run directory")
    assert "not a directory" in one_line(err, tmp_path / "run")


@as_root
def test_private_dir_refuses_foreign_owner(tmp_path):
    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    os.chown(d, NOBODY, NOBODY)
    with pytest.raises(UnsafePathError) as err:
        private.private_dir(d, what="run directory")
    assert f"owned by uid {NOBODY}" in one_line(err, d)


# -- write_atomic --------------------------------------------------------------------------------


def test_write_atomic_writes_and_replaces(tmp_path, umask077):
    p = tmp_path / "f.json"
    private.write_atomic(p, "one\n")
    private.write_atomic(p, b"two\n", fsync=True)
    assert p.read_text() == "two\n"
    assert stat.S_IMODE(os.lstat(p).st_mode) == 0o600
    assert sorted(os.listdir(tmp_path)) == ["f.json"]          # no temp file left behind


def test_write_atomic_replaces_a_symlink_never_follows(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    p = tmp_path / "latest"
    p.symlink_to(victim)
    private.write_atomic(p, "step-1\n")
    assert victim.read_text() == "precious\n"
    assert not p.is_symlink() and p.read_text() == "step-1\n"


def test_write_atomic_mode_is_narrowed_by_umask(tmp_path, umask077):
    p = tmp_path / "f"
    private.write_atomic(p, "x", mode=0o644)
    assert stat.S_IMODE(os.lstat(p).st_mode) == 0o600


def test_write_atomic_temp_names_are_unpredictable(tmp_path, monkeypatch):
    names = []
    real = os.open

    def spy(path, flags, *a):
        names.append(os.fspath(path))
        assert flags & os.O_EXCL and flags & os.O_NOFOLLOW
        return real(path, flags, *a)

    monkeypatch.setattr(private.os, "open", spy)
    private.write_atomic(tmp_path / "f", "a")
    private.write_atomic(tmp_path / "f", "b")
    assert len(set(names)) == 2


def test_write_atomic_failure_leaves_old_file_and_no_temp(tmp_path, monkeypatch):
    p = tmp_path / "f"
    p.write_text("old")

    def boom(*a):
        raise OSError("disk full")

    monkeypatch.setattr(private.os, "replace", boom)
    with pytest.raises(OSError):
        private.write_atomic(p, "new")
    assert p.read_text() == "old" and os.listdir(tmp_path) == ["f"]


# -- open_new / open_append -----------------------------------------------------------------------


def test_open_new_refuses_existing_and_symlink(tmp_path, umask077):
    p = tmp_path / "new.txt"
    with private.open_new(p) as f:
        f.write("x")
    assert stat.S_IMODE(os.lstat(p).st_mode) == 0o600
    with pytest.raises(FileExistsError):
        private.open_new(p)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "link").symlink_to(victim)
    with pytest.raises(UnsafePathError) as err:
        private.open_new(tmp_path / "link", "wb")
    one_line(err, tmp_path / "link")
    (tmp_path / "dangling").symlink_to(tmp_path / "nothing")      # would create a file elsewhere
    with pytest.raises(UnsafePathError):
        private.open_new(tmp_path / "dangling")
    assert not (tmp_path / "nothing").exists() and victim.read_text() == "precious"
    with pytest.raises(ValueError):
        private.open_new(tmp_path / "r", "r")


def test_open_append_appends_and_refuses_symlink(tmp_path):
    p = tmp_path / "log.jsonl"
    for line in ("a\n", "b\n"):
        with private.open_append(p, buffering=1) as f:
            f.write(line)
    assert p.read_text() == "a\nb\n"
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "link").symlink_to(victim)
    with pytest.raises(UnsafePathError) as err:
        private.open_append(tmp_path / "link")
    assert "symlink" in one_line(err, tmp_path / "link") and victim.read_text() == "precious"


@as_root
def test_open_append_refuses_foreign_file(tmp_path):
    p = tmp_path / "log.jsonl"
    p.write_text("theirs\n")
    os.chown(p, NOBODY, NOBODY)
    with pytest.raises(UnsafePathError) as err:
        private.open_append(p)
    assert f"owned by uid {NOBODY}" in one_line(err, p)


def test_open_append_refuses_fifo(tmp_path):
    p = tmp_path / "fifo"
    os.mkfifo(p)
    with pytest.raises((UnsafePathError, OSError)):
        private.open_append(p).close()


# -- copy_tree -----------------------------------------------------------------------------------


def test_copy_tree_copies_files_and_dirs(tmp_path, umask077):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.h5").write_bytes(b"\0" * 3000000)
    (src / "sub" / "manifest.json").write_text("{}")
    dst = tmp_path / "scratch" / "shards"
    private.copy_tree(src, dst)
    assert (dst / "a.h5").read_bytes() == (src / "a.h5").read_bytes()
    assert (dst / "sub" / "manifest.json").read_text() == "{}"
    assert os.stat(dst / "a.h5").st_mtime_ns == os.stat(src / "a.h5").st_mtime_ns
    for p in (dst, dst / "sub"):
        assert stat.S_IMODE(os.lstat(p).st_mode) == 0o700
    private.copy_tree(src, dst)             # into an existing destination: files replaced


def test_copy_tree_refuses_symlink_inside_src(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("someone's data")
    src = tmp_path / "src"
    src.mkdir()
    (src / "ok.h5").write_text("x")
    (src / "evil.h5").symlink_to(secret)
    dst = tmp_path / "dst"
    with pytest.raises(UnsafePathError) as err:
        private.copy_tree(src, dst)
    assert "symlink" in one_line(err, src / "evil.h5")
    assert not dst.exists()                 # checked in full before anything is copied


def test_copy_tree_refuses_symlinked_subdir_and_src(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "x").write_text("x")
    src = tmp_path / "src"
    src.mkdir()
    (src / "sub").symlink_to(outside)
    with pytest.raises(UnsafePathError):
        private.copy_tree(src, tmp_path / "dst")
    (tmp_path / "srclink").symlink_to(outside)
    with pytest.raises(UnsafePathError):
        private.copy_tree(tmp_path / "srclink", tmp_path / "dst2")


def test_copy_tree_replaces_symlink_planted_in_dst(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.h5").write_text("rows")
    victim = tmp_path / "victim"
    victim.write_text("precious")
    dst = tmp_path / "dst"
    dst.mkdir(mode=0o700)
    (dst / "a.h5").symlink_to(victim)
    private.copy_tree(src, dst)
    assert victim.read_text() == "precious" and (dst / "a.h5").read_text() == "rows"
    assert not (dst / "a.h5").is_symlink()


def test_copy_tree_refuses_open_destination(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    dst = tmp_path / "dst"
    dst.mkdir()
    dst.chmod(0o777)
    with pytest.raises(UnsafePathError):
        private.copy_tree(src, dst)


# -- umask ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("text,value", [("077", 0o077), ("027", 0o027), ("0", 0), ("0o22", 0o022), ("0777", 0o777)])
def test_apply_umask(text, value):
    old = private.apply_umask(text)
    try:
        assert os.umask(0o077) == value
    finally:
        os.umask(old)


@pytest.mark.parametrize("text", ["", "88", "abc", "1000", "-1", "0o", "77777"])
def test_apply_umask_refuses_bad_value(text):
    before = os.umask(0o022)
    try:
        with pytest.raises(ValueError) as err:
            private.apply_umask(text)
        assert "run.umask" in str(err.value) and "\n" not in str(err.value)
        assert os.umask(0o022) == 0o022           # unchanged
    finally:
        os.umask(before)


# -- private_scratch -----------------------------------------------------------------------------


def test_private_scratch_is_stable_and_private(tmp_path, umask077):
    a = private.private_scratch(tmp_path, "reflow-run-42")
    b = private.private_scratch(tmp_path, "reflow-run-42")   # a requeue of the same job finds it again
    assert a == b and a.parent == tmp_path and a.name.startswith("reflow-run-42-")
    assert stat.S_IMODE(os.lstat(a).st_mode) == 0o700


def _taken(tmp_path, plant) -> tuple:
    """Plant ``plant(path)`` at the predictable name, then ask for the scratch directory twice."""
    name = private.private_scratch(tmp_path / "probe", "reflow-run-42").name
    root = tmp_path / "tmp"
    root.mkdir()
    plant(root / name)
    return root / name, private.private_scratch(root, "reflow-run-42"), private.private_scratch(root, "reflow-run-42")


def test_private_scratch_taken_by_a_symlink_falls_back_to_a_private_one(tmp_path, capsys):
    trap = tmp_path / "trap"
    trap.mkdir(mode=0o777)
    planted, first, again = _taken(tmp_path, lambda p: p.symlink_to(trap))
    assert first != planted and first.parent == planted.parent and first.name.startswith(planted.name + ".")
    assert again == first                  # a requeue finds the same one
    assert stat.S_IMODE(os.lstat(first).st_mode) == 0o700 and not first.is_symlink()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and str(planted) in err[0] and "symlink" in err[0] and str(first) in err[0]


def test_private_scratch_fallback_is_not_a_planted_lookalike(tmp_path):
    def plant(p):
        p.mkdir()
        p.chmod(0o777)                      # writable by others: taken
        q = p.with_name(p.name + ".0000")   # a lookalike of the fallback, also open to all
        q.mkdir()
        q.chmod(0o777)

    planted, first, _ = _taken(tmp_path, plant)
    assert first.name != planted.name + ".0000" and stat.S_IMODE(os.lstat(first).st_mode) == 0o700


@as_root
def test_private_scratch_taken_by_another_user_falls_back(tmp_path):
    def plant(p):
        p.mkdir(mode=0o700)
        os.chown(p, NOBODY, NOBODY)

    planted, first, again = _taken(tmp_path, plant)
    assert first != planted and again == first and os.lstat(first).st_uid == os.geteuid()
