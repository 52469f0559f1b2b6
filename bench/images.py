"""`python -m bench.images`: loading real-photo JPEGs for training, distlearn against its peers.

    python -m bench.images          # 2,000 images, 3 reps -> bench/RESULTS-images.md
    python -m bench.images --quick  # smoke: 256 images, 1 rep, 2 workers -> bench/out/
    python -m bench.images --rows ceiling mosaic --reps 1

The workload is ImageNet training's: JPEGs of about 400 px a side (bench/photos.py
makes them from real photographs), RandomResizedCrop(224) + flip + normalise
(bench/image_aug.py, the same code in every row), batches of 64. The same images
are served as files and tar shards by nginx on 127.0.0.1, and as Mosaic MDS and
LitData chunks by a moto S3 server on 127.0.0.1; peers that pin old packages run
from their own venvs (scripts/peer-venv.sh, made on first use). Each repetition
of each row is a fresh process timing a cold first epoch (construction, worker
start and first downloads included) and a warm second one on the same loader.
Repetitions go round all rows in turn, alternating direction, so a noisy
neighbour slows every row alike; figures are medians. A loader's figure is its
best worker count (1, 2 or 4), chosen per epoch. CPU seconds per image count the
loader's process and its workers, not the servers (whose CPU is shown apart).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench import photos, report
from bench.image_rows import BUCKET, ROWS, Ctx, s3_env
from bench.procs import free_port, kill_group, tree_cpu_seconds, wait_port
from bench.servers import Server, ensure_nginx

log = logging.getLogger("bench.images")
BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
PEERS = ("mosaic", "litdata", "torchdata")  # rows that run from .venv-<peer>
MDS_SHARD_BYTES = 1 << 24  # shards of about the tar shards' size (200 images)


@dataclass
class Plan:
    """One row configuration to measure."""

    group: str  # ceiling | peer | distlearn
    loader: str  # what the summary compares: one figure per loader (its best setting)
    row: str
    params: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.params.items())
        return f"{self.row}({args})" if args else self.row


def plans(workers: list[int], cores: int) -> list[Plan]:
    out = []
    for work in ("full", "scaled", "simplejpeg"):
        for procs in sorted({1, cores}):
            out.append(Plan("ceiling", f"ceiling-{work}-{procs}p", "ceiling",
                            {"procs": procs, "work": work}))  # fmt: skip
    for loader in ("dataloader-http", "webdataset", "mosaic", "litdata"):
        out += [Plan("peer", loader, loader, {"num_workers": w}) for w in workers]
    # torchdata.nodes' process mapper pickles every image through a queue (half its thread
    # mapper's rate in a trial), so its row is the thread mapper
    out += [Plan("peer", "torchdata", "torchdata", {"num_workers": w, "method": "thread"})
            for w in workers]  # fmt: skip
    # the package's own processor, then the peers' exact work (what the loader alone adds)
    for work, suffix in (("package", ""), ("full", "/pil-work")):
        for row in ("distlearn-csv", "distlearn-shards"):
            out += [
                Plan("distlearn", row + suffix, row,
                     {"workers": "process", "num_workers": w, "work": work})
                for w in workers
            ]  # fmt: skip
    return out


# ---------------------------------------------------------------- the S3 side (moto)


class Moto:
    """moto's S3 server on 127.0.0.1 in a subprocess of the project's venv; always stopped."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.endpoint = ""

    def __enter__(self) -> Moto:
        port = free_port()
        env = dict(os.environ, **s3_env(""))
        env.pop("AWS_ENDPOINT_URL")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.endpoint = f"http://127.0.0.1:{port}"
        wait_port("127.0.0.1", port, self.proc, timeout=60)
        urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=30).close()
        return self

    def upload(self, folder: Path, prefix: str) -> int:
        """Every file under `folder` to s3://BUCKET/prefix/...; returns the bytes sent."""
        import boto3

        s3 = boto3.client("s3", **self.client_kwargs())
        if BUCKET not in [b["Name"] for b in s3.list_buckets().get("Buckets", [])]:
            s3.create_bucket(Bucket=BUCKET)
        total = 0
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            s3.upload_file(str(path), BUCKET, f"{prefix}/{path.relative_to(folder).as_posix()}")
            total += path.stat().st_size
        return total

    def client_kwargs(self) -> dict:
        return {
            "endpoint_url": self.endpoint,
            "aws_access_key_id": "testing",
            "aws_secret_access_key": "testing",
            "region_name": "us-east-1",
        }

    def cpu_seconds(self) -> float:
        return tree_cpu_seconds(self.proc.pid) if self.proc else 0.0

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            kill_group(self.proc)
            self.proc = None


# ---------------------------------------------------------------- peers' venvs and formats


def peer_python(peer: str, install: bool) -> str:
    """The python of .venv-<peer>, made by scripts/peer-venv.sh when missing (and allowed)."""
    venv = REPO / f".venv-{peer}"
    if install:
        subprocess.run(["bash", str(REPO / "scripts" / "peer-venv.sh"), peer], check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip
    python = venv / "bin" / "python"
    if not python.exists():
        raise FileNotFoundError(f"{venv} missing: run scripts/peer-venv.sh {peer}")
    return str(python)


def peer_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra or {})
    return env


def write_peer_format(python: str, fn: str, root: Path, out: Path, size: object) -> Path:
    """Run image_rows.write_mds / write_litdata with the peer's own python (once per data)."""
    done = out / ".complete"
    if done.exists():
        return out
    shutil.rmtree(out, ignore_errors=True)
    code = f"from bench.image_rows import {fn}; {fn}({str(root)!r}, {str(out)!r}, {size!r})"
    subprocess.run([python, "-c", code], check=True, env=peer_env(), cwd=REPO,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    done.touch()
    return out


# ---------------------------------------------------------------- one repetition of one row


def run_child(python: str, spec: dict, env: dict, timeout: float) -> dict:
    proc = subprocess.Popen(
        [python, "-m", "bench.image_child"],
        env=env,
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(json.dumps(spec), timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f}s"}
    finally:
        kill_group(proc)  # workers a row left behind die with it
    line = next((ln for ln in reversed(out.splitlines()) if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        tail = (err or out).strip().splitlines()[-6:]
        return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}
    return json.loads(line[len("RESULT ") :])


def measure(args, data: photos.Photos, emit) -> list[dict]:
    items = data.items()
    cores = len(os.sched_getaffinity(0))
    todo = [p for p in plans(args.workers, cores) if not args.rows or
            any(pat in p.label for pat in args.rows)]  # fmt: skip
    pythons = {None: sys.executable}
    for peer in sorted({ROWS[p.row].venv for p in todo} - {None}):
        try:
            pythons[peer] = peer_python(peer, install=not args.no_install)
        except (subprocess.CalledProcessError, FileNotFoundError) as err:
            note = f"{peer} rows skipped: {err}"
            log.warning(note)
            emit({"kind": "note", "text": note})
            todo = [p for p in todo if ROWS[p.row].venv != peer]
    if not args.no_install:
        ensure_nginx()
    with Server(data.root, kind="auto") as web, Moto() as s3:
        emit({"kind": "server", "text": f"{web.describe()}; moto S3 at {s3.endpoint}"})
        prefixes = {}
        if "mosaic" in pythons:
            mds = write_peer_format(pythons["mosaic"], "write_mds", data.root,
                                    data.root / "mds", MDS_SHARD_BYTES)  # fmt: skip
            prefixes["mds"] = "mds"
            s3.upload(mds, "mds")
        if "litdata" in pythons:
            size = f"{MDS_SHARD_BYTES >> 20}MB"
            lit = write_peer_format(
                pythons["litdata"], "write_litdata", data.root, data.root / "litdata", size
            )
            prefixes["litdata"] = "litdata"
            s3.upload(lit, "litdata")
        env = peer_env(s3_env(s3.endpoint))
        results: dict[str, list[dict]] = {p.label: [] for p in todo}
        for rep in range(args.reps):
            for p in todo if rep % 2 == 0 else todo[::-1]:
                with tempfile.TemporaryDirectory(prefix="bench-images-cache-") as cache:
                    ctx = Ctx(
                        base_url=web.url,
                        root=str(data.root),
                        files=[f for f, _ in items],
                        labels=[lab for _, lab in items],
                        shards=data.shards,
                        batch_size=args.batch_size,
                        s3_endpoint=s3.endpoint,
                        cache_dir=cache,
                        s3=prefixes,
                    )
                    spec = {"row": p.row, "params": p.params, "ctx": asdict(ctx), "epochs": 2}
                    servers0 = web.cpu_seconds() + s3.cpu_seconds()
                    res = run_child(pythons[ROWS[p.row].venv], spec, env, args.row_timeout)
                    res["server_cpu_s"] = web.cpu_seconds() + s3.cpu_seconds() - servers0
                results[p.label].append(res)
                if "error" in res:
                    log.warning("rep %d %s: %s", rep + 1, p.label, res["error"])
                else:
                    e1, e2 = res["epochs"]
                    log.info("rep %d %-48s %7.0f img/s cold %7.0f warm", rep + 1, p.label,
                             e1["samples"] / e1["s"], e2["samples"] / e2["s"])  # fmt: skip
    out = []
    for p in todo:
        reps = results[p.label]
        ok = [r for r in reps if "error" not in r]
        rec = {"kind": "row", "group": p.group, "loader": p.loader, "row": p.row,
               "params": p.params, "label": p.label}  # fmt: skip
        if not ok:
            rec["error"] = reps[0]["error"] if reps else "not run"
        else:
            rec["reps"] = ok
            for k, name in enumerate(("cold", "warm")):
                rates = [r["epochs"][k]["samples"] / r["epochs"][k]["s"] for r in ok]
                cpus = [r["epochs"][k]["cpu_s"] / r["epochs"][k]["samples"] for r in ok]
                rec[name] = {
                    "img_s": report.spread(rates),
                    "cpu_ms_per_img": 1e3 * statistics.median(cpus),
                    "samples": ok[0]["epochs"][k]["samples"],
                }
                if all("main_cpu_s" in r["epochs"][k] for r in ok):
                    rec[name]["main_cpu_ms_per_img"] = 1e3 * statistics.median(
                        r["epochs"][k]["main_cpu_s"] / r["epochs"][k]["samples"] for r in ok
                    )
            rec["server_cpu_ms_per_img"] = 1e3 * statistics.median(
                r["server_cpu_s"] / sum(e["samples"] for e in r["epochs"]) for r in ok
            )
        emit(rec)
        out.append(rec)
    return out


def levers(data: photos.Photos, n: int = 300) -> dict:
    """One-core CPU per image of each decode + augment variant (bench/image_levers.py)."""
    log.info("levers: one core, %d images, each decode + augment variant", n)
    done = subprocess.run(
        [sys.executable, "-m", "bench.image_levers", str(data.root), str(n)],
        env=peer_env(), cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if done.returncode != 0 or line is None:
        return {"kind": "levers", "error": (done.stderr or done.stdout).strip()[-500:]}
    return {"kind": "levers", **json.loads(line[len("RESULT ") :])}


# ---------------------------------------------------------------- report


def best(rows: list[dict], loader: str, epoch: str) -> dict | None:
    """The row of `loader` with the highest median rate in `epoch`."""
    ok = [r for r in rows if r["loader"] == loader and epoch in r]
    return max(ok, key=lambda r: r[epoch]["img_s"]["median"], default=None)


def cpu_bound(rec: dict, ep: str, cores: int) -> float:
    """img/s if the loader kept `cores` idle cores busy: cores / CPU per image (its own and
    the servers'). On a machine shared with other work this says more than the wall clock."""
    if ep not in rec:
        return 0.0
    ms = rec[ep]["cpu_ms_per_img"] + rec.get("server_cpu_ms_per_img", 0.0)
    return cores * 1e3 / ms if ms > 0 else 0.0


def summary(rows: list[dict], cores: int) -> dict:
    """Best settings per loader and per epoch, and the two targets of issue 55."""
    loaders = list(dict.fromkeys(r["loader"] for r in rows if r["group"] != "ceiling"))
    out: dict = {"best": {}, "targets": []}
    for ep in ("cold", "warm"):
        for loader in loaders:
            b = best(rows, loader, ep)
            if b:
                out["best"].setdefault(loader, {})[ep] = b
    one = {w: best(rows, f"ceiling-{w}-1p", "warm") for w in ("full", "scaled", "simplejpeg")}
    for ep in ("cold", "warm"):
        peers = [out["best"][x][ep] for x in loaders if x in out["best"] and ep in out["best"][x]
                 and any(r["group"] == "peer" and r["loader"] == x for r in rows)]  # fmt: skip
        ours = [out["best"][x][ep] for x in loaders if x.startswith("distlearn") and
                ep in out["best"].get(x, {})]  # fmt: skip
        if not peers or not ours:
            continue
        peer = max(peers, key=lambda r: r[ep]["img_s"]["median"])
        us = max(ours, key=lambda r: r[ep]["img_s"]["median"])
        # by CPU time: each row's best rate by CPU per image, as idle cores would give it
        peer_cpu = max(cpu_bound(r, ep, cores) for r in rows if r["group"] == "peer")
        us_cpu = max(cpu_bound(r, ep, cores) for r in rows if r["group"] == "distlearn")
        ratio = us[ep]["img_s"]["median"] / peer[ep]["img_s"]["median"]
        out["targets"].append({
            "epoch": ep, "what": f">= 1.2x the best peer ({peer['label']})",
            "ours": us["label"], "ratio": ratio, "met": ratio >= 1.2,
            "cpu_ratio": us_cpu / peer_cpu, "want": 1.2,
        })  # fmt: skip
        for work, c in one.items():
            if c is None:
                continue
            limit = cores * c["warm"]["img_s"]["median"]  # cores x the one-core rate
            limit_cpu = cores * 1e3 / c["warm"]["cpu_ms_per_img"]
            r = us[ep]["img_s"]["median"] / limit
            out["targets"].append({
                "epoch": ep, "what": f">= 0.9x the {work}-decode ceiling ({cores} x "
                f"{c['warm']['img_s']['median']:.0f} img/s; by CPU {cores} x "
                f"{limit_cpu / cores:.0f})", "ours": us["label"], "ratio": r, "met": r >= 0.9,
                "cpu_ratio": us_cpu / limit_cpu, "want": 0.9,
            })  # fmt: skip
    return out


def _rate(rec: dict, ep: str) -> str:
    s = rec[ep]["img_s"]
    return f"{s['median']:.0f} ({s['min']:.0f}-{s['max']:.0f})"


USAGE = """
## Loading photos with distlearn: what the rows above use

```python
from distlearn.dataset import Dataset
from distlearn.dataset.processors import RandomResizedCrop, Transform

ds = Dataset("https://cdn.example/imagenet/train.csv")   # or ".../train-{000000..000999}.tar"
batcher = ds.sampled_batcher(
    batch_size=64, input_dims=(3, 224, 224), sampler="permutation",
    processor=RandomResizedCrop(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225)),
    device="cuda")                 # optional: batches arrive on the GPU, copied one ahead
for batch in batcher:              # batch.input: float [64, 3, 224, 224]
    ...
```

- `RandomResizedCrop(scale, ratio, flip, mean, std)`: torchvision's
  RandomResizedCrop(224) + RandomHorizontalFlip + ToDtype + Normalize, fused with
  the decode. The crop is drawn before decoding, so a large JPEG is decoded at
  1/2, 1/4 or 1/8 scale when the crop allows it (a crop must be at least 448 px a
  side for 1/2 at 224: on ImageNet-sized photos it rarely applies, on big ones it
  does); JPEGs go to libjpeg-turbo through `simplejpeg` (`pip install
  distlearn[jpeg]`), about twice Pillow's decode speed; the result is written
  straight into the batch.
- `Transform(pipeline)`: your own pipeline on the decoded uint8 tensor `[C, H, W]`
  in the `torchvision.transforms.v2` calling convention, e.g.
  `Transform(v2.Compose([v2.RandomResizedCrop(224), v2.RandomHorizontalFlip(),
  v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)]))`.
- Random draws are the item's own (from the seed, partition, epoch and position):
  the same crops with any number or kind of workers, and after a resume.
- A batch is handed out in the ring's own memory (no copy) and its slot is reused
  only once the batch is gone; `pin_memory=True` gives page-locked batches;
  `device="cuda"` copies the next batch on a side stream while the current step
  runs, and `batcher.stats["device_wait_s"]` is the time steps waited for copies.
  (Measured against DataLoader's `pin_memory` only where a GPU is lent: not in
  this run.)
"""


def markdown(records: list[dict], args, elapsed: float) -> str:
    run = next(r for r in records if r["kind"] == "run")
    data = next(r for r in records if r["kind"] == "data")
    done = next((r for r in records if r["kind"] == "done"), {})
    rows = [r for r in records if r["kind"] == "row"]
    ok = [r for r in rows if "error" not in r]
    mach = run["machine"]
    vers = next((r for r in records if r["kind"] == "versions"), run.get("versions", {}))
    vers = {k: v for k, v in vers.items() if k != "kind"}
    s = summary(ok, mach["cores_usable"])
    lines = [
        "# Image loading: real-photo JPEGs, decode + augment, distlearn against its peers",
        "",
        f"Made by `{' '.join(['python -m bench.images', *run['argv']])}` on {mach['date_utc']} "
        f"(commit {mach['commit']}), {elapsed / 60:.0f} min. A shared machine: other work ran "
        "beside it, so compare the ratios of one run, not absolute figures across runs.",
        "",
        f"- Machine: {mach['cpu']}, {mach['cores_usable']} usable cores, {mach['mem_gib']} GiB, "
        f"Linux {mach['kernel']}, Python {mach['python']}, load average at start "
        f"{', '.join(f'{x:.1f}' for x in mach['loadavg_start'])}"
        + (
            f", at the end {', '.join(f'{x:.1f}' for x in done['loadavg_end'])}"
            if "loadavg_end" in done
            else ""
        )
        + " (1, 5, 15 min).",
        f"- Versions: {', '.join(f'{k} {v}' for k, v in vers.items())}.",
        f"- Data: {data['n']} JPEGs made by bench/photos.py from scikit-image's photographs "
        f"(quality 90, 4:2:0, mean side {data['mean_side']:.0f} px, mean "
        f"{data['bytes'] / data['n'] / 1024:.0f} KiB; ImageNet's mean is about 110 KiB), "
        f"{data['labels']} labels; {data['shards']} tar shards / MDS shards / LitData chunks "
        "of about 16 MiB.",
        f"- Work per image: decode, RandomResizedCrop(224, scale=(0.08, 1)), horizontal flip "
        f"(p=0.5), to float and normalise (bench/image_aug.py), batches of {args.batch_size}; "
        "no shuffling.",
        f"- Serving: {next((r['text'] for r in records if r['kind'] == 'server'), '?')}.",
        f"- {args.reps} repetitions per row, each a fresh process; figures are medians "
        "(min-max). Cold = epoch 1 from the loader's construction; warm = epoch 2, same loader.",
        "",
        "## Best setting of each loader",
        "",
        "| loader | cold img/s | setting | warm img/s | setting | CPU ms/img (warm) "
        "| by CPU img/s (warm) |",
        "|---|---:|---|---:|---|---:|---:|",
    ]
    cores = mach["cores_usable"]
    for loader, eps in s["best"].items():
        c, w = eps.get("cold"), eps.get("warm")
        by_cpu = max(cpu_bound(r, "warm", cores) for r in ok if r["loader"] == loader)
        lines.append(
            f"| {loader} | {_rate(c, 'cold') if c else '-'} | {c['label'] if c else ''} | "
            f"{_rate(w, 'warm') if w else '-'} | {w['label'] if w else ''} | "
            f"{w['warm']['cpu_ms_per_img']:.1f} | "
            f"{by_cpu:.0f} |"
            if w
            else f"| {loader} | - | | - | | | |"
        )
    lines += ["", "## Targets (issue 55)", ""]
    lines += [
        "Each target twice: by the wall clock (the rates above), and by CPU time (each row's "
        "rate if it kept the idle cores busy: cores / its CPU per image, servers included; "
        "the fairer measure on a machine shared with other work).",
        "",
    ]
    for t in s["targets"]:
        mark = "met" if t["met"] else "MISSED"
        cmark = "met" if t["cpu_ratio"] >= t["want"] else "MISSED"
        lines.append(
            f"- {t['epoch']}: {t['what']}: {t['ours']} at {t['ratio']:.2f}x, {mark}; "
            f"by CPU time {t['cpu_ratio']:.2f}x, {cmark}"
        )
    if not s["targets"]:
        lines.append("- not checked: a peer, a distlearn row or a ceiling row is missing")
    lines += [
        "",
        "## Every row",
        "",
        "| group | row | cold img/s | warm img/s | CPU ms/img cold | warm | servers' CPU ms/img |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['group']} | {r['label']} | error: {r['error'][:300]} | | | | |")
            continue
        lines.append(
            f"| {r['group']} | {r['label']} | {_rate(r, 'cold')} | {_rate(r, 'warm')} | "
            f"{r['cold']['cpu_ms_per_img']:.1f} | {r['warm']['cpu_ms_per_img']:.1f} | "
            f"{r['server_cpu_ms_per_img']:.1f} |"
        )
    lines += [
        "",
        "## Where the time goes (warm epoch, each loader's best setting)",
        "",
        f"Per image: the wall time times the {mach['cores_usable']} cores (the CPU the "
        "machine had for it), the CPU the loader's main process and its workers used, "
        "the servers' CPU (nginx, moto: on the same cores), and what is left: idle, "
        "or taken by other work on this shared machine.",
        "",
        "| loader | cores x wall ms | main process CPU ms | workers CPU ms | servers CPU ms "
        "| idle or others ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for loader, eps in s["best"].items():
        w = eps.get("warm")
        if not w or "main_cpu_ms_per_img" not in w["warm"]:
            continue
        budget = mach["cores_usable"] * 1e3 / w["warm"]["img_s"]["median"]
        main_ms = w["warm"]["main_cpu_ms_per_img"]
        workers_ms = w["warm"]["cpu_ms_per_img"] - main_ms
        server_ms = w["server_cpu_ms_per_img"]
        rest = budget - main_ms - workers_ms - server_ms
        lines.append(
            f"| {loader} | {budget:.2f} | {main_ms:.2f} | {workers_ms:.2f} | {server_ms:.2f} "
            f"| {rest:.2f} |"
        )
    if lines[-1].startswith("|---"):
        lines.append("| (the main process's CPU was not recorded in this run) | | | | | |")
    lev = next((r for r in records if r["kind"] == "levers"), None)
    if lev is not None:
        lines += ["", "## One core, no I/O: CPU per image of each decode + augment variant", ""]
        if "error" in lev:
            lines.append(f"failed: {lev['error']}")
        else:
            base = lev["ms_per_img"].get("pil-full")
            lines += [
                f"`python -m bench.image_levers` on {lev['images']} of the images, one thread, "
                "median of 5 passes (bench/image_levers.py says what each variant is).",
                "",
                "| variant | CPU ms/img | img/s per core | vs pil-full |",
                "|---|---:|---:|---:|",
            ]
            for k, ms in lev["ms_per_img"].items():
                rel = f"{base / ms:.2f}x" if base else ""
                lines.append(f"| {k} | {ms:.2f} | {1e3 / ms:.0f} | {rel} |")
            scales = ", ".join(f"{k}: {v}" for k, v in sorted(lev["dct_scales"].items()))
            lines += [
                "",
                f"DCT scales the crops allowed (of {lev['images']}): {scales}; a crop must be "
                "448 px a side to decode at 1/2, so on ~400 px photos the scaled decode "
                "rarely applies.",
            ]
            for k, why in lev.get("missing", {}).items():
                lines.append(f"- {k} not measured: {why}")
    lines += ["", USAGE.strip()]
    notes = [r["text"] for r in records if r["kind"] == "note"]
    if notes:
        lines += ["", "## Notes", "", *[f"- {n}" for n in notes]]
    return "\n".join(lines) + "\n"


def chart(records: list[dict], path: Path) -> Path | None:
    """Each loader's best img/s, cold and warm, with the decode ceilings as lines."""
    rows = [r for r in records if r["kind"] == "row" and "error" not in r]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cores = next(r for r in records if r["kind"] == "run")["machine"]["cores_usable"]
    s = summary(rows, cores)
    loaders = list(s["best"])
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(loaders) + 2))
    colors = {"cold": "#9ab8e0", "warm": "#3070c0"}
    for k, ep in enumerate(("cold", "warm")):
        vals = [s["best"][x][ep][ep]["img_s"]["median"] if ep in s["best"][x] else 0
                for x in loaders]  # fmt: skip
        ax.barh([i + 0.4 * k for i in range(len(loaders))], vals, 0.4, color=colors[ep],
                label=f"{ep} epoch")  # fmt: skip
    for work, style in (("full", "--"), ("simplejpeg", ":")):
        c = best(rows, f"ceiling-{work}-1p", "warm")
        if c:
            x = cores * c["warm"]["img_s"]["median"]
            ax.axvline(x, color="k", ls=style, lw=0.9,
                       label=f"{cores} x one core, {work} decode + augment")  # fmt: skip
    ax.set_yticks([i + 0.2 for i in range(len(loaders))], loaders, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("images/s (median; each loader at its best worker count)")
    ax.set_title("JPEG photos -> RandomResizedCrop(224) + flip + normalise, batches of 64")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def versions(pythons: dict) -> dict:
    """Each peer's version, read from the venv it runs in."""
    out = {}
    for venv, pkgs in ((None, ("torch", "pillow", "numpy", "webdataset", "requests", "aiohttp")),
                       ("mosaic", ("mosaicml-streaming",)), ("litdata", ("litdata", "obstore")),
                       ("torchdata", ("torchdata",))):  # fmt: skip
        python = pythons.get(venv)
        if python is None:
            continue
        code = (
            "import importlib.metadata as m, json\n"
            f"out = {{}}\nfor p in {pkgs!r}:\n"
            "    try: out[p] = m.version(p)\n    except m.PackageNotFoundError: pass\n"
            "print(json.dumps(out))"
        )
        done = subprocess.run([python, "-c", code], capture_output=True, text=True)
        if done.returncode == 0:
            out.update(json.loads(done.stdout))
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.images", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="256 images, 1 rep, 2 workers only")
    p.add_argument("--samples", type=int, help="images per epoch (default 2000; quick 256)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--reps", type=int, help="repetitions per row (default 3; quick 1)")
    p.add_argument("--workers", type=int, nargs="+", help="worker counts (default 1 2 4)")
    p.add_argument("--rows", nargs="+", help="only rows whose label contains one of these")
    p.add_argument("--row-timeout", type=float, default=600.0)
    p.add_argument("--no-install", action="store_true",
                   help="never apt-get nginx nor make the peers' venvs")  # fmt: skip
    p.add_argument("--data-dir", default=str(BENCH / "data"))
    p.add_argument("--out", help="report path (default bench/RESULTS-images.md; quick bench/out/)")
    p.add_argument("--report-from", metavar="JSONL", help="only rebuild the report from records")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.samples = args.samples or (256 if args.quick else 2000)
    args.reps = args.reps or (1 if args.quick else 3)
    args.workers = args.workers or ([2] if args.quick else [1, 2, 4])
    if args.out is None:
        args.out = str(BENCH / ("out/RESULTS-images.md" if args.quick else "RESULTS-images.md"))
    return args


def write(records: list[dict], args, elapsed: float) -> None:
    """The report and the chart; the targets to the log."""
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown(records, args, elapsed))
    try:
        png = chart(records, out.with_name(out.stem.replace("RESULTS", "results") + ".png"))
    except ImportError as err:  # matplotlib is in the bench extra
        log.warning("no chart: %s", err)
        png = None
    rows = [r for r in records if r["kind"] == "row" and "error" not in r]
    for t in summary(rows, records[0]["machine"]["cores_usable"])["targets"]:
        log.info("target %s %s: %.2fx %s; by CPU time %.2fx", t["epoch"], t["what"], t["ratio"],
                 "met" if t["met"] else "MISSED", t["cpu_ratio"])  # fmt: skip
    log.info("wrote %s%s", out, f" and {png}" if png else "")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.report_from:
        records = [json.loads(ln) for ln in Path(args.report_from).read_text().splitlines() if ln]
        run = next(r for r in records if r["kind"] == "run")
        ran = parse_args(run["argv"])  # the run's own settings, this call's --out
        ran.out = args.out if "--out" in (argv or sys.argv[1:]) else ran.out
        done = next((r for r in records if r["kind"] == "done"), {})
        write(records, ran, done.get("elapsed_s", float("nan")))
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    started = time.time()
    jsonl = BENCH / "out" / "images.jsonl"
    jsonl.parent.mkdir(parents=True, exist_ok=True)
    records: list[dict] = []
    data = photos.prepare(Path(args.data_dir) / f"photos-{args.samples}", args.samples)
    with open(jsonl, "w") as f:

        def emit(rec: dict) -> None:
            records.append(rec)
            f.write(json.dumps(rec) + "\n")
            f.flush()

        emit({"kind": "run", "argv": args.argv, "machine": report.machine()})
        emit({"kind": "data", "n": data.n, "bytes": data.bytes, "mean_side": data.mean_side,
              "labels": len(data.labels), "shards": len(data.shards)})  # fmt: skip
        if not args.rows or "levers" in args.rows:
            emit(levers(data))
        measure(args, data, emit)
        pythons = {None: sys.executable}
        for peer in PEERS:
            if (REPO / f".venv-{peer}" / "bin" / "python").exists():
                pythons[peer] = str(REPO / f".venv-{peer}" / "bin" / "python")
        emit({"kind": "versions", **versions(pythons)})
        elapsed = time.time() - started
        emit({"kind": "done", "elapsed_s": elapsed, "loadavg_end": os.getloadavg()})
    write(records, args, elapsed)
    log.info("raw records in %s, %.0f s", jsonl, elapsed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
