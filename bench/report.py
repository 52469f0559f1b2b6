"""Summaries, target checks, the markdown report and the chart.

Targets (issue 7) are checked and printed, never asserted: a shared machine can
make any run miss, and a failing benchmark must still write its report.
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

METRICS = ("rate_excl", "rate_incl", "ttfb_s", "peak_pss_mib", "peak_rss_mib", "cpu_pct",
           "server_cpu_pct")  # fmt: skip


def spread(values: list[float]) -> dict:
    vals = [v for v in values if v == v]  # drop NaN
    if not vals:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan")}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}


def summarize(reps: list[dict]) -> dict:
    """Median, min and max of every metric over the repetitions of one loader row."""
    return {m: spread([r[m] for r in reps]) for m in METRICS if all(m in r for r in reps)}


def summarize_times(times: list[float], nbytes: int, world: int) -> dict:
    """Seconds per op (median, min, max) and the bandwidths of the median."""
    from bench.allreduce import busbw_factor

    s = spread(times)
    algbw = nbytes / s["median"] / 1e6
    return {
        "median_s": s["median"],
        "min_s": s["min"],
        "max_s": s["max"],
        "algbw_MBps": algbw,
        "busbw_MBps": algbw * busbw_factor(world),
    }


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine() -> dict:
    """What the figures were measured on, and how busy it was at the start."""
    import importlib.metadata as md

    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    versions = {}
    for pkg in ("torch", "aiohttp", "pillow", "numpy", "requests", "webdataset", "pyzmq"):
        with contextlib.suppress(md.PackageNotFoundError):
            versions[pkg] = md.version(pkg)
    from bench.servers import find_nginx

    nginx = find_nginx()
    if nginx:
        versions["nginx"] = (
            subprocess.run([nginx, "-v"], capture_output=True, text=True)
            .stderr.strip()
            .split("/")[-1]
        )
    return {
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "mem_gib": round(mem_gib, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "loadavg_start": os.getloadavg(),
        "commit": _run(["git", "-C", str(Path(__file__).parent), "rev-parse", "--short", "HEAD"]),
        "versions": versions,
    }


# ---------------------------------------------------------------- targets


def _best(records: list[dict], **match) -> dict | None:
    """The row with the highest median steady rate among loader rows matching `match`."""
    rows = [
        r
        for r in records
        if r.get("kind") == "loader"
        and "rate_excl" in r
        and all(r.get(k) == v for k, v in match.items())
    ]
    return max(rows, key=lambda r: r["rate_excl"]["median"], default=None)


def _ceiling(records: list[dict], procs: int, decode: bool) -> dict | None:
    return next(
        (
            r
            for r in records
            if r.get("row") == "aiohttp"
            and r["params"] == {"procs": procs, "decode": decode}
            and "rate_excl" in r
        ),
        None,
    )


def _ratio_check(name: str, ours: dict | None, peer: dict | None, want: float, moon=False) -> dict:
    check = {"target": name, "want": want, "moonshot": moon}
    if ours is None or peer is None:
        check.update(status="not measured", ratio=None)
        return check
    ratio = ours["rate_excl"]["median"] / peer["rate_excl"]["median"]
    check.update(
        ratio=ratio,
        ours=ours["label"],
        peer=peer["label"],
        status="met" if ratio >= want else "missed",
        # the same ratio counting start-up: how a short epoch feels
        ratio_incl=ours["rate_incl"]["median"] / peer["rate_incl"]["median"],
    )
    return check


def check_targets(records: list[dict]) -> list[dict]:
    """Every target of the issue, as met / missed / not measured, with the ratio behind it."""
    csv = _best(records, row="dataset-csv")
    shards = _best(records, row="dataset-shards")
    dl = _best(records, row="dataloader-requests")
    wds = _best(records, row="webdataset")
    ran = {r.get("kind") for r in records}
    checks = (
        []
        if "loader" not in ran
        else [
            _ratio_check("per-file HTTP loader vs DataLoader+requests (best)", csv, dl, 3.0),
            _ratio_check(
                "per-file HTTP loader vs 2-process aiohttp+PIL ceiling",
                csv,
                _ceiling(records, 2, True),
                0.8,
            ),
            _ratio_check("per-file HTTP loader vs WebDataset (best)", csv, wds, 1.0, moon=True),
            _ratio_check("tar-shard loader vs WebDataset (best)", shards, wds, 1.3),
        ]
    )
    ar = [r for r in records if r.get("kind") == "allreduce" and "median_s" in r]
    by = {(r["world"], r["size"], r["impl"]): r for r in ar}
    for world in sorted({r["world"] for r in ar}):
        for size in [r["size"] for r in ar if r["world"] == world and r["impl"] == "gloo"]:
            gloo, tree = by.get((world, size, "gloo")), by.get((world, size, "tree"))
            small = (by[(world, size, "gloo")]["bytes"] if gloo else 1 << 30) <= 1 << 20
            big = size in ("16 MiB", "64 MiB")
            wants = [(1.0, False)]
            if small:
                wants.append((2.0, False))
            if big and world == 4:
                wants.append((2.0, True))
            for want, moon in wants:
                check = {"target": f"allreduce {size}, {world} processes: gloo/tree time",
                         "want": want, "moonshot": moon}  # fmt: skip
                if gloo is None or tree is None:
                    check.update(status="not measured", ratio=None)
                else:
                    ratio = gloo["median_s"] / tree["median_s"]
                    check.update(ratio=ratio, status="met" if ratio >= want else "missed")
                checks.append(check)
    if not ar and "allreduce" in ran:
        checks.append({"target": "allreduce vs gloo", "want": 1.0, "moonshot": False,
                       "status": "not measured", "ratio": None})  # fmt: skip
    elif not any(r["impl"] == "tree" for r in ar):
        for c in checks:
            if c["target"].startswith("allreduce"):
                c["status"] = "not measured"
    return checks


def targets_text(checks: list[dict]) -> str:
    lines = ["targets (checked, not asserted):"]
    for c in checks:
        ratio = "   -  " if c.get("ratio") is None else f"{c['ratio']:6.2f}x"
        moon = " (moonshot)" if c["moonshot"] else ""
        lines.append(f"  [{c['status']:>12}] {ratio} >= {c['want']:.1f}x  {c['target']}{moon}")
    return "\n".join(lines)


# ---------------------------------------------------------------- markdown


def paired_ratio(gloo: dict, tree: dict) -> dict:
    """gloo/tree time per repetition (each pair was timed back to back): median, min, max."""
    return spread([g / t for g, t in zip(gloo["times_s"], tree["times_s"], strict=False)])


def _bw(mbps: float) -> str:
    return f"{mbps:,.0f}" if mbps >= 10 else f"{mbps:.3f}"


def _cell(text: str, n: int = 200) -> str:
    """Error text that fits in one markdown table cell."""
    return text[:n].replace("|", "/").replace("\n", " ")


def _fmt(s: dict, scale: float = 1.0, digits: int = 0) -> str:
    med, lo, hi = s["median"] * scale, s["min"] * scale, s["max"] * scale
    if med != med:
        return "-"
    return f"{med:,.{digits}f} ({lo:,.{digits}f}-{hi:,.{digits}f})"


def markdown(records: list[dict], checks: list[dict], mach: dict, args, elapsed: float) -> str:
    mode = "quick" if args.quick else "full"
    out = ["# distlearn benchmark results", ""]
    cmd = " ".join(["python -m bench", *args.argv])
    took = f"{elapsed:.0f} s" if elapsed == elapsed else "cut short: a partial run"
    out.append(f"`{cmd}` ({mode} mode, {took}), {mach['date_utc']}, commit `{mach['commit']}`.")
    out.append("")
    v = mach["versions"]
    out.append(
        f"Machine: {mach['cpu'] or 'unknown CPU'}, {mach['cores_usable']} usable cores, "
        f"{mach['mem_gib']} GiB, Linux {mach['kernel']}, Python {mach['python']}, "
        f"load average at start {mach['loadavg_start'][0]:.2f}. "
        + ", ".join(f"{k} {val}" for k, val in v.items())
        + "."
    )
    out.append("")
    out.append(
        "Each figure is the median of the repetitions with (min-max). Compare ratios, not "
        "absolute figures: they were taken side by side in one run."
    )
    out.append("")
    out += ["## Targets (checked, not asserted)", ""]
    out += [
        "| target | ratio | with start-up | wanted | status |",
        "|---|---:|---:|---:|---|",
    ]
    merged: dict[str, list[dict]] = {}  # one line per target, its thresholds side by side
    for c in checks:
        merged.setdefault(c["target"], []).append(c)
    for name, cs in merged.items():
        c = cs[0]
        ratio = "-" if c.get("ratio") is None else f"{c['ratio']:.2f}x"
        incl = f"{c['ratio_incl']:.2f}x" if c.get("ratio_incl") is not None else ""
        who = f" — {c['ours']} vs {c['peer']}" if c.get("ours") else ""
        want = ", ".join(f">= {x['want']:.1f}x{' (moonshot)' if x['moonshot'] else ''}" for x in cs)
        status = ", ".join(x["status"] for x in cs)
        out.append(f"| {name}{who} | {ratio} | {incl} | {want} | {status} |")
    out.append("")

    loaders = [r for r in records if r.get("kind") == "loader"]
    notes = [r["text"] for r in records if r.get("kind") == "note"]
    if loaders:
        data = next((r for r in records if r.get("kind") == "data"), None)
        server = next((r for r in records if r.get("kind") == "server"), None)
        out += ["## Loaders", ""]
        dl = _best(records, row="dataloader-requests")
        n = loaders[0].get("samples", "?")
        desc = f"{n} samples, batch {args.batch_size}, float [n, 1, 28, 28]"
        if server:
            desc += f", served by {server['text']}"
        out += [desc + f", {args.reps} repetitions (each in a fresh process).", ""]
        out.append(
            "samples/s: steady rate after the first batch; with start-up: all samples over the "
            "whole time from building the loader. Peak memory of the loader's processes together: "
            "PSS (shared pages counted once: the fair figure for forked workers) and the plain RSS "
            "sum. CPU: the loader's processes (100% = one core); server: the HTTP server's. "
            "Loader rows are compared on the steady rate."
        )
        out.append("")
        out.append(
            "| row | samples/s | with start-up | vs DataLoader | first batch s | peak PSS MiB "
            "| peak RSS MiB | CPU % | server CPU % |"
        )
        out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in loaders:
            if "error" in r:
                err = _cell(r["error"], 160)
                out.append(f"| {r['group']}: {r['label']} | failed: {err} ||||||||")
                continue
            vs = "-"
            if dl:
                vs = f"{r['rate_excl']['median'] / dl['rate_excl']['median']:.2f}x"
            out.append(
                f"| {r['group']}: {r['label']} | {_fmt(r['rate_excl'])} | {_fmt(r['rate_incl'])} "
                f"| {vs} | {_fmt(r['ttfb_s'], digits=2)} | {_fmt(r['peak_pss_mib'])} "
                f"| {_fmt(r['peak_rss_mib'])} | {_fmt(r['cpu_pct'])} "
                f"| {_fmt(r['server_cpu_pct'])} |"
            )
        out.append("")
        if data:
            out.append(
                f"Data: {data['samples']} samples ({data['bytes'] / 2**20:.1f} MiB) from "
                f"`{data['source']}`, also packed as {data['shards']} tar shards."
            )
            out.append("")
    for note in notes:
        out += [f"Note: {note}", ""]

    ar = [r for r in records if r.get("kind") == "allreduce"]
    if ar:
        out += ["## Allreduce (float32, sum)", ""]
        out.append(
            "Seconds per op: rank 0's time for back-to-back ops after a barrier, median (min-max) "
            "of the repetitions. algbw = bytes / time; busbw = algbw * 2(n-1)/n."
        )
        out.append("")
        out += [
            "| processes | size | gloo ms/op | tree ms/op | gloo/tree (paired reps) "
            "| gloo busbw MB/s | tree busbw MB/s |",
            "|---:|---|---:|---:|---:|---:|---:|",
        ]
        by = {(r["world"], r.get("size"), r.get("impl")): r for r in ar}
        for r in ar:
            if "error" in r:
                out.append(
                    f"| {r['world']} | {r.get('impl', '')} failed: {_cell(r['error'])} ||||||"
                )
        for r in ar:
            if r.get("impl") != "gloo" or "median_s" not in r:
                continue
            tree = by.get((r["world"], r["size"], "tree"))

            def ms(x):
                return f"{x['median_s'] * 1e3:.3f} ({x['min_s'] * 1e3:.3f}-{x['max_s'] * 1e3:.3f})"

            ratio = "-"
            if tree:
                pr = paired_ratio(r, tree)
                ratio = f"{r['median_s'] / tree['median_s']:.2f}x ({pr['min']:.2f}-{pr['max']:.2f})"
            tree_bw = _bw(tree["busbw_MBps"]) if tree else "-"
            out.append(
                f"| {r['world']} | {r['size']} | {ms(r)} | {ms(tree) if tree else '-'} | {ratio} "
                f"| {_bw(r['busbw_MBps'])} | {tree_bw} |"
            )
        out.append("")

    tr = [r for r in records if r.get("kind") == "training"]
    if tr:
        items = next((r["train_items"] for r in tr if "train_items" in r), "?")
        out += [f"## Training (examples/mnist.py, one epoch, {items} items)", ""]
        out.append(
            "One job per run (examples/launch.py: data over HTTP, N processes, AllReduceSGD over "
            "the backend shown), timed phase by phase through the training loop's hooks "
            "(bench/mnist_timed.py). samples/s: training items of all ranks over the epoch's "
            "training seconds. Phases: share of each rank's epoch, averaged over ranks."
        )
        out.append("")
        out += [
            "| processes | backend | samples/s | vs 1 process | epoch s | loading % | compute % "
            "| allreduce % | whole job s |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        one = next((r for r in tr if r["nodes"] == 1 and "items_per_s" in r), None)
        for r in tr:
            if "error" in r:
                err = _cell(r["error"])
                out.append(f"| {r['nodes']} | {r['backend']} | failed: {err} |||||||")
                continue
            vs = f"{r['items_per_s']['median'] / one['items_per_s']['median']:.2f}x" if one else "-"
            out.append(
                f"| {r['nodes']} | {r['backend']} | {_fmt(r['items_per_s'])} | {vs} "
                f"| {_fmt(r['epoch_s'], digits=1)} | {_fmt(r['loading_pct'])} "
                f"| {_fmt(r['compute_pct'])} | {_fmt(r['allreduce_pct'])} "
                f"| {_fmt(r['job_wall_s'], digits=1)} |"
            )
        out.append("")
    out.append(f"Reproduce: `python -m bench{' --quick' if args.quick else ''}` "
               "(raw figures, every repetition: `bench/out/results.jsonl`).")  # fmt: skip
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- chart


def chart(records: list[dict], path: Path) -> Path | None:
    """Loader rates relative to the best DataLoader, and gloo/tree allreduce ratios."""
    loaders = [r for r in records if r.get("kind") == "loader" and "rate_excl" in r]
    ar = [r for r in records if r.get("kind") == "allreduce" and "median_s" in r]
    if not loaders and not ar:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in (loaders, ar) if p]
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 6), squeeze=False)
    axes = list(axes[0])
    if loaders:
        ax = axes.pop(0)
        dl = _best(records, row="dataloader-requests") or loaders[0]
        base = dl["rate_excl"]["median"]
        colors = {"ceiling": "#999999", "peer": "#e08030", "distlearn": "#3070c0"}
        labels = [f"{r['group']}: {r['label']}" for r in loaders]
        med = [r["rate_excl"]["median"] / base for r in loaders]
        lo = [m - r["rate_excl"]["min"] / base for m, r in zip(med, loaders, strict=True)]
        hi = [r["rate_excl"]["max"] / base - m for m, r in zip(med, loaders, strict=True)]
        y = range(len(loaders))
        ax.barh(y, med, xerr=[lo, hi], color=[colors[r["group"]] for r in loaders])
        ax.set_yticks(list(y), labels, fontsize=8)
        ax.invert_yaxis()
        ax.axvline(1.0, color="k", lw=0.8)
        ax.axvline(3.0, color="#3070c0", lw=0.8, ls="--", label="target: 3x DataLoader")
        ax.set_xlabel(f"samples/s relative to {dl['label']} (median, min-max)")
        ax.set_title("Loaders over HTTP")
        ax.legend(fontsize=8, loc="lower right")
    if ar:
        ax = axes.pop(0)
        by = {(r["world"], r["size"], r["impl"]): r for r in ar}
        worlds = sorted({r["world"] for r in ar})
        sizes = list(dict.fromkeys(r["size"] for r in ar))
        width = 0.8 / max(1, len(worlds))
        for k, world in enumerate(worlds):
            ratios, lo, hi = [], [], []
            for size in sizes:
                g, t = by.get((world, size, "gloo")), by.get((world, size, "tree"))
                ratio = g["median_s"] / t["median_s"] if g and t else 0.0
                pr = paired_ratio(g, t) if g and t else {"min": ratio, "max": ratio}
                ratios.append(ratio)
                lo.append(max(0.0, ratio - pr["min"]))
                hi.append(max(0.0, pr["max"] - ratio))
            ax.bar([i + k * width for i in range(len(sizes))], ratios, width, yerr=[lo, hi],
                   label=f"{world} processes")  # fmt: skip
        ax.set_xticks([i + width * (len(worlds) - 1) / 2 for i in range(len(sizes))], sizes)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(2.0, color="#3070c0", lw=0.8, ls="--", label="target up to 1 MiB: 2x")
        ax.set_ylabel("gloo time / ipc tree time (higher: tree faster)")
        ax.set_title("all_reduce float32 sum, one host")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
