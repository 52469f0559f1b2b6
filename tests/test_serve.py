"""The loopback static server used by examples, tests and benchmarks."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest


def get(url: str, headers: dict | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def test_serves_files_and_ranges(tmp_path, serve_dir):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.bin").write_bytes(bytes(range(256)))
    base = serve_dir(tmp_path)
    assert get(base + "sub/a.bin") == (200, bytes(range(256)))
    assert get(base + "sub/a.bin", {"Range": "bytes=10-19"}) == (206, bytes(range(10, 20)))
    assert get(base + "missing.bin")[0] == 404
    assert get(base + "../../etc/passwd")[0] == 404


def test_busy_port_falls_back_to_a_free_one(tmp_path, serve_dir):
    (tmp_path / "x.txt").write_text("hello")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        base = serve_dir(tmp_path, port=taken)
        assert f":{taken}/" not in base
        assert get(base + "x.txt") == (200, b"hello")


@pytest.mark.parametrize("bad", ["does-not-exist"])
def test_refuses_a_missing_directory(tmp_path, bad):
    import subprocess
    import sys

    from conftest import repo_env

    r = subprocess.run(
        [sys.executable, "-m", "distlearn.dataset.serve", str(tmp_path / bad)],
        env=repo_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2
    assert "not a directory" in r.stderr
