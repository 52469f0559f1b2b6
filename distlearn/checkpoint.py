"""Checkpoint: one collective save of everything a job needs, restored at any world size.

    ckpt = Checkpoint("s3://bucket/run/", comm, keep=2)
    state = {"model": model, "optim": opt, "data": batcher}
    step = ckpt.restore(state) or 0           # None when there is none yet
    for batch in batcher:
        ...                                    # forward, backward, sgd, optimizer step
        step += 1
        ckpt.step(step, state)                 # saves every `every` steps; on a
                                               # preemption saves and exits 0

Values are anything with ``state_dict``/``load_state_dict`` (torch's ``Stateful``), of
three kinds:

- *replicated* (the default: a model, an optimizer, a scheduler, as data-parallel ranks
  hold them alike): rank 0 saves it; on restore rank 0 reads it and every rank gets it
  through the communicator (one read of the store, not one per rank);
- *elastic* (an object whose ``elastic_state`` is true, such as a batcher): every rank's
  state is small, gathered into the manifest, and restored as the list of every old
  rank's states at another world size (its own at the same one);
- *per rank* (``Checkpoint.per_rank(obj)``: state each rank holds its own share of):
  each rank saves its own, restored at the same world size only.

Each rank's RNG states (torch, CUDA, numpy's global, ``random``) go in too, so a job
resumed at the same world size draws what it would have drawn.

Layout (``directory`` a local path or any fsspec URL)::

    step-000000001200-5f3a9c01/     the step and a nonce (a save of the same step again
        replicated.pt              writes a new folder: nothing complete is overwritten)
        rank-00000.pt ...           per-rank objects and RNG states
        MANIFEST.json               written last: the commit point

A save is atomic: every rank writes and syncs its files, the communicator gathers their
sizes and SHA-256s (which is also the barrier), then rank 0 writes the manifest (locally
to a temporary name, synced and renamed; on an object store one PUT). ``restore`` takes
the newest checkpoint whose manifest exists and whose files match it, and skips (saying
why, at WARNING) a partial or corrupt one. ``keep`` complete checkpoints are kept; older
ones go only once a newer one is complete.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import random
import re
import secrets
import shutil
import signal
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from . import preemption
from .comm import Communicator, check_communicator
from .state import broadcast_state_dict, gather_bytes, share_bytes

__all__ = ["Checkpoint", "CheckpointError"]

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
REPLICATED = "replicated.pt"
FORMAT = 1
_FOLDER = re.compile(r"^step-(\d{12})-([0-9a-f]{8})$")


class CheckpointError(RuntimeError):
    """A save that could not be completed, or a checkpoint that cannot be restored here."""


class PerRank:
    """A value each rank saves and restores its own (see :meth:`Checkpoint.per_rank`)."""

    def __init__(self, obj: Any):
        _check_stateful(obj, "per_rank()")
        self.obj = obj

    def state_dict(self) -> Any:
        return self.obj.state_dict()

    def load_state_dict(self, state: Any) -> Any:
        return self.obj.load_state_dict(state)


class Checkpoint:
    """Collective saves and restores under `directory` (see the module docstring).

    ``keep``: complete checkpoints kept (None: all). ``every``: ``step()`` saves every that
    many steps (None: only on a preemption). ``signals``: those that raise the stop flag
    (distlearn.preemption; ``()`` installs none). ``grace``: seconds after such a signal
    within which the process must have saved; past it the process exits with status 1
    rather than be killed mid-write by its scheduler (None: no limit). ``exit``: on a
    preemption ``step()`` raises SystemExit(0) after its save (False: returns True).
    ``storage_options`` go to fsspec; ``device``: where collectives' small tensors go
    (default: CUDA for an NCCL communicator, the communicator's ``device`` if it has
    one, else the CPU).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        comm: Communicator,
        keep: int | None = 2,
        *,
        every: int | None = None,
        signals: Iterable[int] = (signal.SIGTERM, signal.SIGUSR1),
        grace: float | None = None,
        exit: bool = True,
        storage_options: Mapping[str, Any] | None = None,
        device: torch.device | str | None = None,
    ):
        self.comm = check_communicator(comm)
        for name, value in (("keep", keep), ("every", every)):
            if value is not None and not (_is_int(value) and value >= 1):
                raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")
        if grace is not None and not (isinstance(grace, int | float) and grace > 0):
            raise ValueError(f"grace must be a positive number of seconds or None, got {grace!r}")
        self.keep, self.every, self.grace, self.exit = keep, every, grace, exit
        self.directory = os.fspath(directory)
        self.local = "://" not in self.directory or self.directory.startswith("file://")
        if self.local:  # (no fsspec needed: plain files, synced and renamed)
            self.fs = None
            self.root = os.path.abspath(self.directory.removeprefix("file://"))
        else:
            import fsspec

            self.fs, self.root = fsspec.core.url_to_fs(
                self.directory, **dict(storage_options or {})
            )
            self.root = self.root.rstrip("/")
        self.device = torch.device(device) if device is not None else _device_of(comm)
        self.rank, self.world = comm.node_index, comm.num_nodes
        self.signals = preemption.install(signals) if signals else []
        self._saved_step: int | None = None
        self.restored_from: str | None = None  # the folder restore() read, if any
        self.last_saved: str | None = None  # the folder the last save() completed
        self._saved_round = 0  # the round (preemption.exchanges) of the last save by step()
        self._own_rounds = 0  # step()'s own collectives, where no rider carries the flag
        if grace is not None and self.signals:
            threading.Thread(target=self._watchdog, name="checkpoint-grace", daemon=True).start()

    def __repr__(self) -> str:
        return f"Checkpoint({self.directory!r}, node {self.rank} of {self.world}, keep={self.keep})"

    @staticmethod
    def per_rank(obj: Any) -> PerRank:
        """Mark `obj` as state every rank holds its own part of (saved by each rank)."""
        return PerRank(obj)

    # ------------------------------------------------------------------ saving

    def save(self, step: int, objects: Mapping[str, Any]) -> str:
        """Save `objects` as checkpoint `step` (every rank calls it, at the same point of
        its loop; ranks whose steps differ save as the highest). Returns the checkpoint's
        folder once it is complete on every rank."""
        if not _is_int(step) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        kinds = _kinds(objects)
        # The step (ranks of uneven epochs count different steps: the highest is the
        # job's, and every rank resumes from it) and rank 0's nonce.
        nonce = secrets.randbits(32) if self.rank == 0 else 0
        agree = self._tensor([step, -step, nonce])
        self.comm.all_reduce(agree, op="max")
        lo, step, nonce = -int(agree[1]), int(agree[0]), int(agree[2])
        if lo != step:
            log.info("checkpoint: the ranks are at steps %d to %d; saving as step %d",
                     lo, step, step)  # fmt: skip
        folder = f"{self.root}/step-{step:012d}-{nonce:08x}"
        mine: dict[str, Any] = {"files": {}, "data": {}}
        try:
            if self.local:
                os.makedirs(folder, exist_ok=True)
            per_rank = {k: o.state_dict() for k, o in objects.items() if kinds[k] == "per_rank"}
            name = f"rank-{self.rank:05d}.pt"
            mine["files"][name] = self._put(
                folder, name, {"rng": _rng_state(), "objects": per_rank}
            )
            if self.rank == 0:
                replicated = {k: o.state_dict() for k, o in objects.items()
                              if kinds[k] == "replicated"}  # fmt: skip
                mine["files"][REPLICATED] = self._put(folder, REPLICATED, replicated)
            for k, o in objects.items():
                if kinds[k] == "elastic":
                    mine["data"][k] = _json_able(o.state_dict(), f"{k}.state_dict()")
        except Exception as err:  # still take part in the gather: nobody may hang
            log.exception("checkpoint step %d: rank %d could not write", step, self.rank)
            mine = {"error": f"{type(err).__name__}: {err}"}
        everyone = [json.loads(b) for b in self._gather(json.dumps(mine).encode())]
        failed = [(r, b["error"]) for r, b in enumerate(everyone) if "error" in b]
        if failed:
            raise CheckpointError(
                f"checkpoint step {step} not saved: "
                + "; ".join(f"rank {r}: {e}" for r, e in failed[:8])
            )
        published = 1
        if self.rank == 0:
            try:
                self._publish(folder, step, kinds, everyone)
            except Exception:
                log.exception("checkpoint step %d: rank 0 could not write %s", step, MANIFEST)
                published = 0
        ok = self._tensor([published if self.rank == 0 else 0])
        self.comm.all_reduce(ok)
        if int(ok[0]) != 1:
            raise CheckpointError(f"checkpoint step {step} not saved: rank 0 could not "
                                  f"publish its manifest (see rank 0's log)")  # fmt: skip
        self._saved_step = step
        self.last_saved = self._url(folder)
        if self.rank == 0:
            self._prune(folder)
        return self.last_saved

    def _put(self, folder: str, name: str, obj: Any) -> list:
        buf = io.BytesIO()
        torch.save(_on_cpu(obj), buf)
        data = buf.getvalue()
        self._write(f"{folder}/{name}", data)
        return [len(data), hashlib.sha256(data).hexdigest()]

    def _write(self, path: str, data: bytes) -> None:
        """Write `path` whole and durably: local files are synced (and renamed into place
        from a temporary name), an object store's PUT is atomic."""
        if not self.local:
            self.fs.pipe_file(path, data)
            return
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(os.path.dirname(path))

    def _publish(self, folder: str, step: int, kinds: dict, everyone: list[dict]) -> None:
        files: dict[str, list] = {}
        for b in everyone:
            files.update(b["files"])
        manifest = {
            "format": FORMAT,
            "step": step,
            "world_size": self.world,
            "time": time.time(),
            "objects": kinds,
            "files": files,
            "data": {
                k: [b["data"][k] for b in everyone]
                for k, kind in kinds.items()
                if kind == "elastic"
            },
        }
        self._write(f"{folder}/{MANIFEST}", json.dumps(manifest, indent=1).encode())

    # ------------------------------------------------------------------ listing, pruning

    def _folders(self) -> list[tuple[int, str, bool]]:
        """(step, folder, has a manifest) of every checkpoint folder, newest step first."""
        try:
            entries = self.fs.ls(self.root, detail=False, refresh=True) if not self.local else [
                f"{self.root}/{n}" for n in os.listdir(self.root)]  # fmt: skip
        except FileNotFoundError:
            return []
        manifests = set()
        if entries:
            found = self.fs.glob(f"{self.root}/step-*/{MANIFEST}") if not self.local else [
                f"{self.root}/{n}/{MANIFEST}" for n in os.listdir(self.root)
                if os.path.exists(f"{self.root}/{n}/{MANIFEST}")]  # fmt: skip
            manifests = {p.rstrip("/").rsplit("/", 2)[-2] for p in found}
        out = []
        for entry in entries:
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            m = _FOLDER.match(name)
            if m:
                out.append((int(m.group(1)), f"{self.root}/{name}", name in manifests))
        out.sort(key=lambda x: (x[0], x[2]), reverse=True)
        return out

    def _prune(self, newest: str) -> None:
        """Remove complete checkpoints past the newest `keep`, and partial folders older than
        the newest complete one (never before a newer one is complete)."""
        try:
            folders = self._folders()
            complete = [f for f in folders if f[2]]
            if not complete:
                return
            keep = complete if self.keep is None else complete[: self.keep]
            kept = {f[1] for f in keep} | {newest}
            newest_step = complete[0][0]
            for step, folder, done in folders:
                if folder in kept:
                    continue
                if done or step <= newest_step:
                    if self.local:
                        shutil.rmtree(folder)
                    else:
                        self.fs.rm(folder, recursive=True)
        except Exception:  # a failed clean-up costs space, not data
            log.warning("checkpoint: pruning %s failed", self.directory, exc_info=True)

    def latest(self) -> int | None:
        """The step of the newest complete checkpoint (by its manifest; files not read)."""
        complete = [f for f in self._folders() if f[2]]
        return complete[0][0] if complete else None

    # ------------------------------------------------------------------ restoring

    def restore(self, objects: Mapping[str, Any]) -> int | None:
        """Load the newest complete checkpoint into `objects` (every rank calls it); returns
        its step, or None when there is none (then nothing is loaded)."""
        kinds = _kinds(objects)
        tried: set[str] = set()
        candidates = self._folders() if self.rank == 0 else []
        while True:
            manifest, folder = None, ""
            if self.rank == 0:
                manifest, folder = self._next_candidate(candidates, tried)
            shared = self._share(
                json.dumps([folder, manifest]).encode() if self.rank == 0 else None
            )
            folder, manifest = json.loads(shared)
            if manifest is None:
                log.info("checkpoint: none to restore in %s", self.directory)
                return None
            self._check_objects(manifest, kinds, folder)
            same_world = manifest["world_size"] == self.world
            try:
                loaded = self._read_mine(folder, manifest, same_world)
                ok = 1
            except CheckpointError as err:
                log.warning("checkpoint %s: %s", self._url(folder), err)
                loaded, ok = None, 0
            verdict = self._tensor([ok])
            self.comm.all_reduce(verdict, op="min")
            if int(verdict[0]) == 1:
                break
            tried.add(folder)
            if self.rank == 0:
                log.warning("checkpoint %s: skipped (a rank found a file missing or corrupt)",
                            self._url(folder))  # fmt: skip
        replicated, own = loaded
        per_rank = [k for k, kind in kinds.items() if kind == "per_rank"]
        if per_rank and not same_world:
            raise CheckpointError(
                f"{', '.join(map(repr, per_rank))}: per-rank state saved by "
                f"{manifest['world_size']} ranks cannot be restored by {self.world}"
            )
        for key, obj in objects.items():
            if kinds[key] == "replicated":
                state = broadcast_state_dict(
                    self.comm, replicated.get(key) if self.rank == 0 else None, self.device
                )
                obj.load_state_dict(state)
            elif kinds[key] == "elastic":
                states = manifest["data"][key]
                obj.load_state_dict(states[self.rank] if same_world else states)
            else:
                obj.load_state_dict(own["objects"][key])
        if same_world:
            _set_rng_state(own["rng"])
        else:
            _seed_rngs(manifest["step"], self.rank)
            log.info("checkpoint: saved by %d ranks, restored by %d: RNG states seeded from "
                     "(step, rank), not restored", manifest["world_size"], self.world)  # fmt: skip
        self._saved_step = manifest["step"]
        self.restored_from = self._url(folder)
        log.info("checkpoint: restored step %d from %s", manifest["step"], self.restored_from)
        return int(manifest["step"])

    def _next_candidate(self, candidates, tried) -> tuple[dict | None, str]:
        """Rank 0: the newest folder with a readable manifest whose files exist at their sizes."""
        for step, folder, done in candidates:
            if folder in tried:
                continue
            tried.add(folder)
            where = self._url(folder)
            if not done:
                log.warning("checkpoint %s: no %s (a save that did not finish): skipped",
                            where, MANIFEST)  # fmt: skip
                continue
            try:
                manifest = json.loads(self._read(f"{folder}/{MANIFEST}"))
                if manifest.get("format") != FORMAT or manifest.get("step") != step:
                    raise ValueError(f"format {manifest.get('format')!r}, step "
                                     f"{manifest.get('step')!r}")  # fmt: skip
                for name, (size, _) in manifest["files"].items():
                    path = f"{folder}/{name}"
                    got = os.path.getsize(path) if self.local else self.fs.size(path)
                    if got != size:
                        raise ValueError(f"{name} has {got} bytes, the manifest says {size}")
            except Exception as err:
                log.warning("checkpoint %s: skipped: %s", where, err)
                continue
            return manifest, folder
        return None, ""

    def _read_mine(self, folder: str, manifest: dict, same_world: bool) -> tuple[dict, dict]:
        """This rank's files, checked against the manifest: (replicated (rank 0), own)."""
        replicated, own = {}, {"rng": None, "objects": {}}
        if self.rank == 0:
            replicated = self._load(folder, REPLICATED, manifest)
        if same_world:
            own = self._load(folder, f"rank-{self.rank:05d}.pt", manifest)
        return replicated, own

    def _load(self, folder: str, name: str, manifest: dict) -> Any:
        if name not in manifest["files"]:
            raise CheckpointError(f"{name} is not in the manifest")
        size, digest = manifest["files"][name]
        try:
            data = self._read(f"{folder}/{name}")
        except Exception as err:
            raise CheckpointError(f"{name}: {type(err).__name__}: {err}") from err
        if len(data) != size or hashlib.sha256(data).hexdigest() != digest:
            raise CheckpointError(f"{name} does not match its checksum in the manifest")
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)

    def _read(self, path: str) -> bytes:
        if self.local:
            with open(path, "rb") as f:
                return f.read()
        return self.fs.cat_file(path)

    def _check_objects(self, manifest: dict, kinds: dict, folder: str) -> None:
        saved = manifest["objects"]
        missing = sorted(set(kinds) - set(saved))
        if missing:
            raise CheckpointError(f"{self._url(folder)} holds no {', '.join(map(repr, missing))} "
                                  f"(it holds {', '.join(map(repr, saved))})")  # fmt: skip
        for key, kind in kinds.items():
            if saved[key] != kind:
                raise CheckpointError(f"{key!r} was saved as {saved[key]} state and is "
                                      f"{kind} state here")  # fmt: skip

    # ------------------------------------------------------------------ preemption

    def step(self, step: int, objects: Mapping[str, Any]) -> bool:
        """Once a training step, after the optimizer's: saves every `every` steps, and when
        a preemption is agreed (all ranks learn it in the same step), saves and exits 0
        (returns True with ``exit=False``). Returns False otherwise.

        The flag rides AllReduceSGD's and AllReduceEA's all-reduces, and so does the
        count of steps (their rounds, the same on every rank) that `every` counts. In the
        steps where some rank has finished its epoch and waits for the others (uneven
        partitions), nothing is saved: that rank is not calling this; the save comes at
        the first step every rank takes again. A loop with neither AllReduceSGD nor
        AllReduceEA pays one small all-reduce here for the flag, and must call this
        where every rank does."""
        if preemption.exchanges() == 0:  # nothing carries the flag: carry it ourselves
            flag = self._tensor([preemption.local_flag()])
            self.comm.all_reduce(flag)
            preemption.observe(int(flag[0]), rider=False)
            self._own_rounds += 1
            rounds = self._own_rounds
        else:
            rounds = preemption.exchanges()
            if not preemption.full():
                return False  # a rank is draining an uneven epoch: no collective now
        stop = preemption.agreed()
        due = self.every is not None and rounds // self.every > self._saved_round // self.every
        if stop or due:
            self.save(step, objects)
            self._saved_round = rounds
        if not stop:
            return False
        log.warning("preemption: saved step %d; stopping", self._saved_step)
        if self.exit:
            raise SystemExit(0)
        return True

    def _watchdog(self) -> None:
        while preemption.requested() is None:
            time.sleep(0.2)
        asked = time.monotonic()
        while time.monotonic() - asked < self.grace:
            time.sleep(0.2)
        log.error("preemption: no save %gs after %s; exiting with status 1",
                  self.grace, preemption.requested())  # fmt: skip
        logging.shutdown()
        os._exit(1)

    # ------------------------------------------------------------------ collectives

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _gather(self, data: bytes) -> list[bytes]:
        return gather_bytes(self.comm, data, self.device)

    def _share(self, data: bytes | None) -> bytes:
        return share_bytes(self.comm, data, self.device)

    def _url(self, path: str) -> str:
        return path if self.local else self.fs.unstrip_protocol(path)


# ----------------------------------------------------------------------------- helpers


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_stateful(obj: Any, where: str) -> None:
    missing = [m for m in ("state_dict", "load_state_dict") if not callable(getattr(obj, m, None))]
    if missing:
        raise TypeError(f"{where}: {type(obj).__name__} has no {' or '.join(missing)}")


def _kinds(objects: Mapping[str, Any]) -> dict[str, str]:
    if not isinstance(objects, Mapping) or not objects:
        raise TypeError("objects must be a non-empty dict of name -> object with state_dict")
    out = {}
    for key, obj in objects.items():
        if not isinstance(key, str):
            raise TypeError(f"checkpoint keys are strings, got {key!r}")
        _check_stateful(obj, f"objects[{key!r}]")
        if isinstance(obj, PerRank):
            out[key] = "per_rank"
        elif getattr(obj, "elastic_state", False):
            out[key] = "elastic"
        else:
            out[key] = "replicated"
    return out


def _on_cpu(x: Any) -> Any:
    """`x` with its tensors on the CPU (an XLA tensor cannot be saved where it is; a CUDA
    one would be loaded back onto its device, which a restore on another host may lack)."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu() if x.device.type != "cpu" else x
    if isinstance(x, dict):
        return type(x)((k, _on_cpu(v)) for k, v in x.items())
    if isinstance(x, list | tuple):
        return type(x)(_on_cpu(v) for v in x)
    return x


def _json_able(state: Any, where: str) -> Any:
    try:
        return json.loads(json.dumps(state))
    except TypeError as err:
        raise TypeError(f"{where} must be JSON (ints, strings, lists, dicts): {err}") from None


def _device_of(comm: Any) -> torch.device:
    dev = getattr(comm, "device", None)
    if isinstance(dev, torch.device):
        return dev
    group = getattr(comm, "group", None)
    try:
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_backend(group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
    except (ImportError, RuntimeError, ValueError):
        pass
    return torch.device("cpu")


def _fsync_dir(path: str) -> None:
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rng_state() -> dict:
    np_state = np.random.get_state()
    out = {
        "torch": torch.get_rng_state(),
        "numpy": [
            np_state[0],
            torch.from_numpy(np_state[1].astype(np.int64)),
            int(np_state[2]),
            int(np_state[3]),
            float(np_state[4]),
        ],
        "random": _py_state(random.getstate()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def _py_state(state: Any) -> Any:
    if isinstance(state, tuple):
        return [_py_state(x) for x in state]
    return state


def _set_rng_state(state: dict | None) -> None:
    if not state:
        return
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    version, internal, gauss = state["random"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _seed_rngs(step: int, rank: int) -> None:
    seq = np.random.SeedSequence([step, rank], spawn_key=(0xC4E9,))
    s64 = int(seq.generate_state(1, np.uint64)[0])
    torch.manual_seed(s64 & ((1 << 63) - 1))
    np.random.seed(s64 & 0xFFFFFFFF)
    random.seed(s64)
