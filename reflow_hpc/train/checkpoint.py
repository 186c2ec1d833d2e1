"""Checkpoints: one directory per step, written atomically, with a ``latest`` pointer.

Layout under the checkpoint root::

    step_000010/
        model/           Hugging Face directory: config.json, *.safetensors, tokenizer files
        trainer.pt       trainer state (optimizer, scheduler, step; under ppo the critic: its weights,
                         optimizer, schedule and step) and the RNG states of python, numpy and torch
                         (CPU and every CUDA device)
        extra/<key>.json what the caller adds: the coordinator stores the replay-buffer index and
                         each worker's shard manifest here
        partials/        (a run that stopped early) the samples being generated, to continue after a
                         resume (reflow_hpc.storage.partials)
        meta.json        step and the keys of ``extra``; written last, so its presence marks a
                         complete directory
    latest               one line: the name of the newest complete step directory

Rules it implements:

- **Atomic.** Everything is written into a hidden temporary sibling (``.step_000010.tmp-<pid>``),
  flushed to disk, and renamed into place; then ``latest`` is replaced atomically
  (``private.write_atomic``: a temp file of unpredictable name renamed over it, so a symlink planted
  at either name is never written through). A crash leaves either the previous checkpoint or the new one, never a
  half-written directory that looks valid. Leftover temporary directories are ignored by readers
  and removed by the next save.
- **Found.** :func:`latest_checkpoint` follows ``latest``; when it is missing or names a
  directory that is gone, the newest complete ``step_*`` directory is used.
- **Retention.** ``keep_last = K > 0`` keeps the newest K step directories after a save (0 keeps
  all); the one just written is never removed.
- **Exact resume.** Model tensors go through safetensors and the optimizer state through
  ``torch.save``, both bit-exact, so a run resumed from step k takes the same next step as the
  uninterrupted run. ``trainer.pt`` is read with ``weights_only=True``: it holds only tensors and
  plain Python values.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..policy import no_progress_bars
from ..private import private_dir, write_atomic

_STEP_DIR = re.compile(r"^step_(\d{6,})$")
_EXTRA_KEY = re.compile(r"^[A-Za-z0-9_.-]+$")
LATEST = "latest"


@dataclass
class Checkpoint:
    """What :func:`load_checkpoint` read."""
    path: Path
    step: int
    trainer_state: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def model_dir(self) -> Path:
        return self.path / "model"


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


# ------------------------------------------------------------------ RNG states

def rng_states() -> dict[str, Any]:
    """RNG states of python, numpy's global generator and torch, as plain values and tensors."""
    kind, key, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(np.asarray(key, dtype=np.int64)), int(pos), int(has_gauss), float(gauss)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_states(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    kind, key, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, key.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ------------------------------------------------------------------ save

def save_checkpoint(root: str | os.PathLike, step: int, *, model: Any, tokenizer: Any = None,
                    trainer_state: dict[str, Any], extra: dict[str, Any] | None = None, keep_last: int = 0,
                    fsync: bool = True, include: dict[str, Path] | None = None) -> Path:
    """Write ``root/step_<step>/`` atomically, point ``root/latest`` at it, apply retention.

    ``trainer_state`` is :meth:`reflow_hpc.train.trainer.Trainer.state_dict` (a ``model`` entry is
    dropped: the model is stored as a Hugging Face directory). ``extra`` maps file-name-safe keys
    to JSON-able values. ``include`` maps names to directories that move into the checkpoint under
    those names (files staged by other ranks; a staging directory must be on the same file system).
    Returns the step directory.
    """
    if step < 0:
        raise ValueError(f"checkpoint step {step}: must be ≥ 0")
    if keep_last < 0:
        raise ValueError(f"keep_last = {keep_last}: must be ≥ 0 (0 keeps every checkpoint)")
    extra = dict(extra or {})
    for key in extra:
        if not _EXTRA_KEY.match(key):
            raise ValueError(f"checkpoint extra key {key!r}: use letters, digits, '_', '.', '-' only (a file name)")
    root = private_dir(root, what="checkpoint directory")
    _remove_stale_temporaries(root, keep={Path(d).name for d in (include or {}).values()})
    name = step_dir_name(step)
    final = root / name
    tmp = root / f".{name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(mode=0o700)             # new (never an existing one): mkdir does not follow a symlink
        with no_progress_bars():          # a bar per checkpoint is only noise in the run's log
            model.save_pretrained(tmp / "model", safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp / "model")
        state = {k: v for k, v in trainer_state.items() if k != "model"}
        torch.save({"step": int(step), "trainer": state, "rng": rng_states()}, tmp / "trainer.pt")
        (tmp / "extra").mkdir(mode=0o700)
        for key, value in extra.items():
            write_atomic(tmp / "extra" / f"{key}.json", json.dumps(value))
        for part, directory in (include or {}).items():     # not `name`: the pointer below needs it
            os.rename(directory, tmp / part)
        write_atomic(tmp / "meta.json", json.dumps({"step": int(step), "extra": sorted(extra), "format": 1}))
        if fsync:
            _fsync_tree(tmp)
        old = None
        if final.exists():
            # A directory cannot be renamed over a non-empty one: move the old one aside first.
            old = root / f".{name}.old-{os.getpid()}"
            final.rename(old)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    write_atomic(root / LATEST, name + "\n", fsync=fsync)
    if keep_last > 0:
        for path in _complete_steps(root)[:-keep_last]:
            if path.name != name:
                shutil.rmtree(path, ignore_errors=True)
    return final


def staging_dir(root: str | os.PathLike, step: int, name: str) -> Path:
    """Where other ranks stage files for the checkpoint of ``step`` (``include`` moves them in)."""
    return Path(root) / f".{step_dir_name(step)}.{name}"


def _remove_stale_temporaries(root: Path, keep: set[str] = frozenset()) -> None:
    for p in root.iterdir():
        if p.name.startswith(f".{LATEST}.") and p.name.endswith(".tmp"):   # a pointer write a crash cut short
            p.unlink(missing_ok=True)
            continue
        if p.name.startswith(".step_") and p.name not in keep and (".tmp-" in p.name or ".old-" in p.name
                                                                    or p.name.count(".") >= 2):
            shutil.rmtree(p, ignore_errors=True)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        _fsync_file(path)
    except OSError:   # some file systems refuse fsync on directories; the data files are synced
        pass


def _fsync_tree(top: Path) -> None:
    for dirpath, _, files in os.walk(top):
        for f in files:
            _fsync_file(Path(dirpath) / f)
        _fsync_dir(Path(dirpath))


# ------------------------------------------------------------------ find and load

def _complete_steps(root: Path) -> list[Path]:
    """Complete step directories (with meta.json), oldest first."""
    found = []
    for p in root.iterdir() if root.is_dir() else ():
        m = _STEP_DIR.match(p.name)
        if m and (p / "meta.json").is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``root`` (see the module docstring), or None."""
    root = Path(root)
    pointer = root / LATEST
    if pointer.is_file():
        name = pointer.read_text().strip()
        if _STEP_DIR.match(name) and (root / name / "meta.json").is_file():
            return root / name
    steps = _complete_steps(root)
    return steps[-1] if steps else None


def _read_meta(path: Path) -> tuple[dict, dict[str, Path]]:
    """meta.json of step directory ``path``, checked before anything in it is used: a JSON object whose
    ``step`` is an int and whose ``extra`` keys are plain file names whose files lie inside ``path/extra``
    (after symlinks are resolved). A checkpoint directory may come from elsewhere; a key such as
    ``../../x`` must not make the loader read a file outside it. Returns (meta, key -> file)."""
    where = path / "meta.json"
    try:
        meta = json.loads(where.read_text())
    except (ValueError, OSError) as e:
        raise ValueError(f"checkpoint {where}: unreadable: {e}") from None
    if not isinstance(meta, dict):
        raise ValueError(f"checkpoint {where}: a JSON {type(meta).__name__}, not an object")
    step = meta.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"checkpoint {where}: step {step!r} is not a step number")
    keys = meta.get("extra", [])
    if not isinstance(keys, list):
        raise ValueError(f"checkpoint {where}: extra is a {type(keys).__name__}, not a list of names")
    folder = (path / "extra").resolve()
    files = {}
    for key in keys:
        file = folder / f"{key}.json" if isinstance(key, str) and _EXTRA_KEY.fullmatch(key) else None
        if file is None or key in (".", "..") or file.resolve().parent != folder:
            raise ValueError(f"checkpoint {where}: extra key {key!r} is not a plain file name inside {folder}")
        files[key] = file
    return meta, files


def load_checkpoint(path: str | os.PathLike, *, model: Any = None, trainer: Any = None, restore_rng: bool = True,
                    map_location: str | torch.device = "cpu") -> Checkpoint:
    """Read a step directory; load its weights into ``model`` (default: ``trainer.model``), its
    trainer state into ``trainer`` and, with ``restore_rng``, the RNG states of this process."""
    path = Path(path)
    if not (path / "meta.json").is_file():
        why = "no such directory" if not path.exists() else "incomplete (no meta.json)"
        raise FileNotFoundError(f"checkpoint {path}: {why}")
    meta, extra_files = _read_meta(path)
    blob = torch.load(path / "trainer.pt", map_location=map_location, weights_only=True)
    extra = {key: json.loads(file.read_text()) for key, file in extra_files.items()}
    if model is None and trainer is not None:
        model = trainer.model
    if model is not None:
        load_model_weights(model, path / "model")
    if trainer is not None:
        trainer.load_state_dict(blob["trainer"])
    if restore_rng:
        set_rng_states(blob["rng"])
    return Checkpoint(path=path, step=int(meta["step"]), trainer_state=blob["trainer"], extra=extra)


def load_model_weights(model: Any, model_dir: str | os.PathLike) -> None:
    """Copy the safetensors weights of a Hugging Face directory into ``model`` in place.

    Every parameter of the model must be present (tied parameters are stored once); a tensor the
    model lacks or a shape that differs fails naming the tensor and the directory. A sharded
    parameter (a trainer's DTensor) takes this rank's rows of the stored tensor.
    """
    from safetensors.torch import load_file

    from .sharding import copy_full_into

    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"checkpoint model {model_dir}: no *.safetensors files")
    targets = dict(model.named_parameters())
    targets.update((n, b) for n, b in model.named_buffers() if n not in targets)
    seen = set()
    with torch.no_grad():
        for f in files:
            for name, value in load_file(str(f)).items():
                target = targets.get(name)
                if target is None:
                    if name in dict(model.named_parameters(remove_duplicate=False)):
                        continue      # the second name of a tied parameter
                    raise ValueError(f"checkpoint model {model_dir}: tensor {name} is not in the "
                                     f"{type(model).__name__}")
                if tuple(value.shape) != tuple(target.shape):
                    raise ValueError(f"checkpoint model {model_dir}: {name} has shape {tuple(value.shape)}, the "
                                     f"model's is {tuple(target.shape)}")
                copy_full_into(target, value)
                seen.add(name)
    missing = [n for n in dict(model.named_parameters()) if n not in seen]
    if missing:
        raise ValueError(f"checkpoint model {model_dir}: {len(missing)} parameters missing, first {missing[0]}")


# Config keys a resumed run must share with the checkpoint: the buffer index, the shard manifests
# and the saved tensors are laid out by them (the objective: the advantages the index holds come from
# its estimator, and ppo's critic is saved only by ppo). Any other key may change between the two runs.
RESUME_FIXED = ("algorithm.group_size", "algorithm.name", "resources.workers", "resources.trainer_replicas",
                "resources.rollout_instances", "model.dtype", "model.tiny_", "task.")


def resume_changes(checkpoint: Path, now: dict) -> tuple[list, list]:
    """Split the config changes since ``checkpoint`` into (fixed keys, free keys); see RESUME_FIXED."""
    path = checkpoint / "extra" / "config.json"
    if not path.is_file():
        return [], []
    from ..config import config_changes
    changes = config_changes(json.loads(path.read_text()), now)
    fixed = [c for c in changes if any(c[0] == k or (k.endswith(("_", ".")) and c[0].startswith(k))
                                       for k in RESUME_FIXED)]
    return fixed, [c for c in changes if c not in fixed]
