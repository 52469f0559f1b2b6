"""distlearn.common: the helpers dataset and ipc shared by copy before, one copy each now.

Each test of a unification holds the cases where the copies disagreed: both users of
the helper now answer alike (the same value, the same error type).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from distlearn import ipc
from distlearn.common import envvars, keywords, launchers, net
from distlearn.common.errors import RemoteTraceback
from distlearn.dataset import Dataset, errors
from distlearn.dataset.fetch.fetcher import Fetcher
from distlearn.dataset.options import FetchOptions
from distlearn.ipc.rendezvous import env as rendezvous_env

# ---- environment variables -----------------------------------------------------------


def test_an_empty_variable_is_an_unset_one(monkeypatch):
    monkeypatch.setenv("DL_X", "")
    assert envvars.env_str("DL_X", "d") == "d"
    assert envvars.env_int("DL_X", 3) == 3
    assert envvars.env_float("DL_X", 0.5) == 0.5
    assert envvars.env_flag("DL_X", True) is True
    monkeypatch.delenv("DL_X")
    assert envvars.env_int("DL_X") is None


@pytest.mark.parametrize(
    "value, want",
    [(" 12 ", 12), ("+3", 3), ("0", 0)],
)
def test_env_int_reads_decimal_integers(monkeypatch, value, want):
    monkeypatch.setenv("DL_X", value)
    assert envvars.env_int("DL_X", low=0) == want


@pytest.mark.parametrize("value", ["1.5", "x", "1_000", "\u0663", "0x10", "-1"])
def test_env_int_refuses_what_is_not_one_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("DL_X", value)
    with pytest.raises(envvars.EnvError, match=r"\$DL_X=.*must be an integer >= 0") as err:
        envvars.env_int("DL_X", low=0)
    assert isinstance(err.value, ValueError) and err.value.name == "DL_X"


@pytest.mark.parametrize("value", ["nan", "inf", "x", "-1"])
def test_env_float_refuses_what_is_not_a_finite_number(monkeypatch, value):
    monkeypatch.setenv("DL_X", value)
    with pytest.raises(envvars.EnvError, match=r"\$DL_X=.*must be a finite number"):
        envvars.env_float("DL_X", low=0)


@pytest.mark.parametrize(
    "value, want", [("1", True), ("0", False), ("TRUE", True), ("off", False), (" yes ", True)]
)
def test_env_flag(monkeypatch, value, want):
    monkeypatch.setenv("DL_X", value)
    assert envvars.env_flag("DL_X", not want) is want


def test_env_flag_refuses_a_word_it_does_not_know(monkeypatch):
    """$IPC_BULK=2 was "on", $IPC_SHM_CMA=no was "on" too (only "0" was off)."""
    monkeypatch.setenv("IPC_BULK", "no")
    from distlearn.ipc.services import arena

    assert arena.enabled() is False
    monkeypatch.setenv("IPC_BULK", "2")
    with pytest.raises(envvars.EnvError, match=r"\$IPC_BULK='2': must be 1 or 0"):
        arena.enabled()


def test_ipc_variables_share_one_error(monkeypatch):
    """$IPC_BULK_ARENA_MB said only its value, $IPC_PORT's error was an IPCError, $IPC_TIMEOUT's
    a ValueError of its own wording: one EnvError naming the variable and its rule."""
    from distlearn.ipc.services import arena

    monkeypatch.setenv("IPC_BULK_ARENA_MB", "lots")
    with pytest.raises(envvars.EnvError, match=r"\$IPC_BULK_ARENA_MB='lots': must be an integer"):
        arena.arena_bytes()
    for var in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("IPC_PORT", "port")
    with pytest.raises(envvars.EnvError, match=r"\$IPC_PORT='port': must be an integer"):
        rendezvous_env.from_env()


# ---- launchers -----------------------------------------------------------------------

LAUNCH_VARS = [
    "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "IPC_PORT",
    "IPC_KEY", "IPC_TOKEN", "IPC_TOKEN_FILE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
    "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_ID", "SLURM_NNODES", "SLURM_JOB_NUM_NODES",
    "SLURM_STEP_NUM_NODES", "SLURM_JOB_ID", "SLURM_NODELIST", "SLURM_STEP_NODELIST",
]  # fmt: skip


@pytest.fixture
def clean_env(monkeypatch):
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)

    def set_env(**values: str) -> None:
        for k, v in values.items():
            monkeypatch.setenv(k, v)

    return set_env


def _dataset_partition(tmp_path, **kw):
    path = tmp_path / "i.csv"
    path.write_text("filename\n" + "".join(f"{i}\n" for i in range(8)))
    ds = Dataset(str(path), **kw)
    return ds.partition, ds.partitions


def test_torchrun_static_and_slurm_read_alike(clean_env):
    clean_env(RANK="1", WORLD_SIZE="4", LOCAL_WORLD_SIZE="4", MASTER_PORT="1",
              TORCHELASTIC_RUN_ID="r")  # fmt: skip
    got = launchers.detect()
    assert (got.launcher, got.rank, got.world, got.one_host) == ("torchrun", 1, 4, True)
    clean_env(TORCHELASTIC_RUN_ID="", LOCAL_WORLD_SIZE="")  # (empty: unset)
    got = launchers.detect()
    assert (got.launcher, got.one_host, got.variables) == ("static", None, "RANK/WORLD_SIZE")
    clean_env(RANK="", WORLD_SIZE="", SLURM_PROCID="2", SLURM_NTASKS="3", SLURM_STEP_ID="0")
    clean_env(SLURM_STEP_NUM_NODES="2", SLURM_STEP_NODELIST="gpu[07-09]", SLURM_JOB_ID="5")
    got = launchers.detect()
    assert (got.launcher, got.rank, got.world, got.one_host) == ("slurm", 2, 3, False)
    assert (got.root, got.key) == ("gpu07", "slurm:5:0")
    clean_env(RANK="0", WORLD_SIZE="2")  # torchrun inside a Slurm step: torchrun's ranks
    assert launchers.detect().launcher == "static"


def test_a_batch_script_is_no_rank_for_the_dataset_or_the_tree(clean_env, tmp_path):
    """What a Slurm batch script's own shell sees (sbatch -n 2, Slurm 22.05): SLURM_PROCID=0
    and the allocation's SLURM_NTASKS, no SLURM_STEP_ID. `Tree.from_env` took it for rank 0
    of 2 and waited for a rank 1 that never comes; `Dataset(partition="auto")` read half
    the index. Both now run it as the single process it is."""
    clean_env(SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_NNODES="1", SLURM_JOB_ID="9")
    assert launchers.detect() is None
    assert _dataset_partition(tmp_path, partition="auto") == (0, 1)
    handler = rendezvous_env.from_env()
    assert (handler.node_index, handler.num_nodes) == (0, 1)
    clean_env(SLURM_STEP_ID="0")  # the same under srun: rank 0 of 2, for both
    assert _dataset_partition(tmp_path, partition="auto") == (0, 2)
    assert _dataset_partition(tmp_path) == (0, 2)  # (no arguments: the launcher's ranks)
    handler = rendezvous_env.from_env()
    assert (handler.node_index, handler.num_nodes) == (0, 2)


@pytest.mark.parametrize(
    "env, match",
    [
        ({"WORLD_SIZE": "4"}, r"\$WORLD_SIZE is set without \$RANK"),
        ({"RANK": "1"}, r"\$RANK is set without \$WORLD_SIZE"),
        ({"SLURM_PROCID": "1", "SLURM_STEP_ID": "0"}, r"\$SLURM_PROCID is set without"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, r"\$RANK='x': must be an integer >= 0"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, r"\$RANK=2 is not in \[0, \$WORLD_SIZE=2\)"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, r"\$WORLD_SIZE='0': must be an integer >= 1"),
    ],
)
def test_a_broken_launch_is_one_error_for_the_dataset_and_the_tree(clean_env, tmp_path, env,
                                                                   match):  # fmt: skip
    """Dataset said ValueError and let RANK alone pass (every rank read partition 0);
    Tree.from_env said IPCError and read no rank range: now one LaunchError (a
    ValueError), the same cases refused by both."""
    clean_env(MASTER_PORT="29500", **env)
    with pytest.raises(launchers.LaunchError, match=match):
        _dataset_partition(tmp_path, partition="auto")
    with pytest.raises(launchers.LaunchError, match=match):
        _dataset_partition(tmp_path)
    with pytest.raises(launchers.LaunchError, match="Tree.from_env: " + match):
        ipc.Tree.from_env()


def test_a_slurm_node_list_names_its_first_host():
    assert launchers.first_slurm_host("gpu[03-05,07],cpu1") == "gpu03"
    assert launchers.first_slurm_host("n1,n2") == "n1"


# ---- did you mean --------------------------------------------------------------------


def _batcher(**opts):
    ds = Dataset({"x": torch.zeros(2, 1), "y": torch.zeros(2, dtype=torch.long)})
    return ds.sampled_batcher(input_dims=(1,), sampler="label-distribution", **opts)


@pytest.mark.parametrize(
    "call, name, near",
    [
        (lambda tmp: Dataset(str(tmp), num_worker=2), "num_worker", "num_workers"),
        (lambda tmp: ipc.Client("127.0.0.1", 1, tiemout=1), "tiemout", "timeout"),
        (
            lambda tmp: Dataset(
                {"x": torch.zeros(2, 1), "y": torch.zeros(2, dtype=torch.long)}
            ).sampled_batcher(
                input_dims=(1,), sampler="label-distribution", sampler_opt={"weight": {}}
            ),
            "weight",
            "weights",
        ),
    ],
)
def test_every_misspelt_keyword_is_a_type_error_naming_the_closest(tmp_path, call, name, near):
    """Dataset's options and ipc's keywords raised TypeError, a sampler's options a
    ValueError; one check for all three now."""
    (tmp_path / "i.csv").write_text("filename\na\n")
    with pytest.raises(TypeError, match=f"unknown .*'{name}'; did you mean '{near}'"):
        call(tmp_path / "i.csv")


def test_no_close_name_lists_the_valid_ones():
    with pytest.raises(TypeError, match=r"f\(\) got an unknown option 'zzz'; valid: alpha, beta"):
        keywords.check("f()", ["zzz"], ["beta", "alpha"], noun="option")
    assert keywords.closest("retrys", ["retries", "timeout"]) == "retries"


# ---- is_loopback ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "host, want",
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("[::1]", True),
        ("::ffff:127.0.0.1", True),
        ("localhost", True),
        ("LOCALHOST.", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.1", False),
        ("", False),
        ("localhost.example.com", False),
    ],
)
def test_is_loopback(host, want):
    assert net.is_loopback(host) is want


def test_this_host_s_own_name_is_not_loopback_for_the_server_or_the_tree():
    """The two copies disagreed on this machine's own name (here in /etc/hosts as
    127.0.0.1): the rendezvous took it for loopback (a StaticTree rooted at it met
    through the runtime directory, with no secret, though other hosts reach it by that
    name), the Server did not (it asked for a secret). Both ask for one now."""
    name = socket.gethostname()
    assert not net.is_loopback(name)
    env = {k: v for k, v in os.environ.items() if k not in ("IPC_TOKEN", "IPC_TOKEN_FILE")}
    code = textwrap.dedent(f"""
        import sys
        from distlearn import ipc
        for make in (lambda: ipc.Server({name!r}, port=0),
                     lambda: ipc.StaticTree(0, 1, {name!r}, 1)):
            try:
                make().close()
            except ipc.IPCError as err:
                assert "IPC_TOKEN" in str(err), err
            else:
                sys.exit("no secret asked for")
    """)
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)


def test_ipv6_loopback_needs_no_secret_for_the_tree(monkeypatch):
    """The rendezvous resolved names with IPv4's gethostbyname: "::1" was no loopback to
    it, and a StaticTree rooted there asked for a secret a one-host tree does not need."""
    monkeypatch.delenv("IPC_TOKEN", raising=False)
    monkeypatch.delenv("IPC_TOKEN_FILE", raising=False)
    tree = ipc.StaticTree(0, 1, "::1", 1)
    try:
        t = torch.ones(2)
        assert tree.all_reduce(t) == 1
    finally:
        tree.close()


# ---- die with the parent -------------------------------------------------------------

PARENT = """
import os, signal, sys, threading, time
from distlearn.common.procs import die_with_parent
parent = os.getpid()
def fork():
    pid = os.fork()
    if pid == 0:
        if sys.argv[1] == "exec":
            die_with_parent(parent, before_exec=True)
            os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(120)"])
        die_with_parent(parent)
        time.sleep(120)
        os._exit(0)
    print(pid, flush=True)
if sys.argv[1] == "exec":  # (the death signal: fired by the end of the forking thread)
    fork()
else:  # forked by a thread that ends: the child must outlive it
    t = threading.Thread(target=fork)
    t.start(); t.join()
time.sleep(120)
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("how", ["fork", "exec"])
def test_a_child_dies_with_its_parent_process(how):
    """serve.py's workers, ipc.map's and the example launcher's children each had their own
    helper (one died with the forking thread, one raised where prctl failed)."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT, how], stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    try:
        child = int(parent.stdout.readline())
        time.sleep(1.0)
        assert not _gone(child), "the child died before its parent"
        parent.kill()
        parent.wait(timeout=30)
        deadline = time.monotonic() + 20
        while not _gone(child):
            assert time.monotonic() < deadline, "the child outlived its parent"
            time.sleep(0.05)
    finally:
        parent.kill()
        parent.wait(timeout=30)
        with __import__("contextlib").suppress(NameError, ProcessLookupError):
            os.kill(child, signal.SIGKILL)


# ---- one class, one set of defaults ----------------------------------------------------


def test_remote_traceback_is_one_class():
    assert errors.RemoteTraceback is ipc.RemoteTraceback is RemoteTraceback
    assert str(RemoteTraceback("tb")) == '\n"""\ntb"""'


def test_the_fetcher_s_defaults_and_checks_are_the_read_policy_s():
    """Fetcher held its own copy of the defaults and checked only some of them."""
    f = Fetcher()
    policy = FetchOptions()
    for name in ("timeout", "retries", "backoff", "max_backoff", "redirects", "max_item_bytes"):
        assert getattr(f, name) == getattr(policy, name), name
    for bad in ({"backoff": -1}, {"timeout": "30"}, {"headers": [("a", "b")]}):
        with pytest.raises((TypeError, ValueError)) as want:
            FetchOptions(**bad)
        with pytest.raises(type(want.value), match=re.escape(str(want.value))):
            Fetcher(**bad)
