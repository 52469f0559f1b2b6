"""bench.training's account of the waiting for the last rank, on made-up timelines
(what each phase of each rank took is known, so the split has one right answer)."""

from __future__ import annotations

import pytest

from bench.training import arrival_split


def _rank(loading: list[float], compute: list[float]) -> dict:
    """A rank's moments over steps that all leave the all-reduce together (as they do)."""
    began, fwd, entered, left = [], [], [], []
    t = 0.0
    for lo, co in zip(loading, compute, strict=True):
        began.append(t)
        fwd.append(t + lo)
        entered.append(t + lo + co)
        t += 1.0  # every rank leaves step s at s + 1.0 (>= the last arrival)
        left.append(t)
    return {"began": began, "fwd": fwd, "entered": entered, "left": left, "epoch_s": t}


def test_waiting_is_split_into_the_last_ranks_lead_per_phase():
    # step 0: rank 1 is last, its batch came 0.2 s later; step 1: rank 0 is last, it
    # computed 0.1 s longer; step 2: rank 1 is last by 0.05 s of loading and 0.05 of compute
    r0 = _rank([0.1, 0.1, 0.1], [0.3, 0.4, 0.3])
    r1 = _rank([0.3, 0.1, 0.15], [0.3, 0.3, 0.35])
    out = arrival_split([r0, r1])
    # the waiting: rank 0 waits 0.2 (step 0) and 0.1 (step 2), rank 1 waits 0.1 (step 1)
    assert out["wait_last_pct"] == pytest.approx(100 * (0.3 / 3 + 0.1 / 3) / 2)
    assert out["late_loading_pct"] == pytest.approx(100 * (0.25 / 3) / 2)
    assert out["late_compute_pct"] == pytest.approx(100 * (0.05 / 3 + 0.1 / 3) / 2)
    assert out["late_other_pct"] == pytest.approx(0.0, abs=1e-9)
    assert out["last_same_pct"] == pytest.approx(100 * 2 / 3)
    total = out["late_loading_pct"] + out["late_compute_pct"] + out["late_other_pct"]
    assert total == pytest.approx(out["wait_last_pct"])


def test_a_late_start_is_neither_loading_nor_compute():
    # rank 1 began step 1 0.2 s later (it left the previous step late): "other"
    r0 = _rank([0.1, 0.1], [0.3, 0.3])
    r1 = _rank([0.1, 0.1], [0.3, 0.3])
    for key in ("began", "fwd", "entered"):
        r1[key][1] += 0.2
    out = arrival_split([r0, r1])
    assert out["late_other_pct"] == pytest.approx(100 * (0.2 / 2) / 2)
    assert out["late_loading_pct"] == pytest.approx(0.0, abs=1e-9)
    assert out["late_compute_pct"] == pytest.approx(0.0, abs=1e-9)


def test_timelines_without_phase_moments_give_only_the_two_way_split():
    r = _rank([0.1], [0.2])
    old = [{k: v for k, v in r.items() if k not in ("began", "fwd")} for _ in range(2)]
    assert set(arrival_split(old)) == {
        "wait_last_pct", "after_last_pct", "first_back_ms", "back_ms"
    }  # fmt: skip


def test_after_the_last_call_is_split_into_the_first_return_and_the_rest():
    # two steps; the last rank calls at 0.4 and 1.4; rank 0 is back 1 ms after it in
    # step 0 and 3 ms in step 1, rank 1 (out of a core's queue) 5 ms and 9 ms after it
    r0 = _rank([0.1, 0.1], [0.3, 0.3])
    r1 = _rank([0.1, 0.1], [0.2, 0.2])
    r0["left"], r1["left"] = [0.401, 1.403], [0.405, 1.409]
    out = arrival_split([r0, r1])
    # medians of two steps: the upper one (steps // 2)
    assert out["first_back_ms"] == pytest.approx(3.0)
    assert out["back_ms"] == pytest.approx(6.0)  # (3 + 9) / 2; step 0: (1 + 5) / 2


@pytest.mark.slow  # (24 s of benchmark harness: the default suite keeps under 15 minutes)
@pytest.mark.timeout(600)
def test_the_ddp_reference_trains_with_ddp_and_is_timed_like_allreduce_sgd():
    # The same loop, 2 processes over gloo, the quick data (launch.py prepares it once):
    # the job must really be DDP (not AllReduceSGD under another name), and its
    # all-reduce phase must be measured (each step from its bucket's hook to the end
    # of backward), split by arrival like AllReduceSGD's.
    from bench.training import run_once

    res = run_once(2, "gloo", quick=True, timeout=540, ddp=True)
    assert "error" not in res, res.get("error")
    assert res["algorithm"] == "DistributedDataParallel"
    assert res["steps"] > 0 and res["test_accuracy"] > 0.5
    assert 0 < res["allreduce_pct"] < 100
    assert res["wait_last_pct"] + res["after_last_pct"] <= res["allreduce_pct"] + 1e-6
    total = res["loading_pct"] + res["compute_pct"] + res["allreduce_pct"]
    assert total == pytest.approx(100, abs=5)


def test_the_before_row_names_a_checkouts_commit_only_at_its_top(tmp_path):
    # --before takes another checkout; its commit heads the table. git looks upwards
    # for a repository, so a tree exported into a folder of this one must not be
    # reported with this repository's commit (the device runs did exactly that).
    import subprocess
    from pathlib import Path

    from bench.training import revision

    def git(*args, cwd):
        subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)

    repo = tmp_path / "checkout"
    repo.mkdir()
    git("init", "-q", cwd=repo)
    (repo / "f").write_text("x")
    git("add", "f", cwd=repo)
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one", cwd=repo)
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True
    ).stdout.strip()
    assert revision(repo) == head
    (repo / "exported").mkdir()
    assert revision(repo / "exported").startswith("commit unknown")
    assert revision(Path(tmp_path / "nowhere")).startswith("commit unknown")


def test_before_must_be_a_checkout_with_the_example_and_its_timer(tmp_path, capsys):
    from bench.training import main

    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "launch.py").write_text("")
    with pytest.raises(SystemExit) as exc:
        main(["--before", str(tmp_path), "--reps", "1"])
    assert exc.value.code == 2
    assert "no bench/mnist_timed.py there" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_a_job_that_runs_out_of_time_says_what_it_was_doing():
    # A timed-out epoch used to be reported as "timed out" alone; the output it left
    # names the stage it was in (preparing the quick data, serving it, or training).
    from bench.training import run_once

    res = run_once(2, "ipc", quick=True, timeout=6)
    said = res["error"].removeprefix("timed out after 6s: ")
    assert said != res["error"], res["error"]
    assert any(w in said for w in ("prepare_mnist", "launch", "distlearn", "mnist.py")), said


def test_a_job_stopped_before_it_printed_anything_says_it_was_starting():
    # At 6 s on a loaded machine the job above can still be importing torch, silent.
    from bench.training import run_once

    res = run_once(2, "ipc", quick=True, timeout=0.01)
    assert res["error"] == "timed out after 0s: no output yet: launch.py was starting", res
