"""Credentials go only to the origins the user named, and a remote index cannot send the
trainer to loopback, link-local or private addresses: real servers on 127.0.0.1 (the
index's origin, and a second port as another origin) that record what arrived."""

from __future__ import annotations

import logging

import pytest

from distlearn.dataset import Dataset, Fetcher, FetchError
from distlearn.dataset.fetch.scope import Scope, TargetRefused, scope_for
from distlearn.dataset.processors import Raw
from tests.recording_server import recording

SECRET = {"Authorization": "Bearer s3cret", "X-Api-Key": "k"}
FAST = dict(backoff=0.01, timeout=5.0, retries=1)


def www(root, rows: list[str], meta: str | None = None):
    """items/0..3.bin (4 bytes of i each) and train.csv naming `rows` under `root`."""
    (root / "items").mkdir(parents=True, exist_ok=True)
    for i in range(4):
        (root / "items" / f"{i}.bin").write_bytes(bytes([i]) * 4)
    (root / "train.csv").write_text("filename\n" + "\n".join(rows) + "\n")
    if meta is not None:
        (root / "train-meta.csv").write_text(f"prefix\n{meta}\n")
    return root


def epoch(ds, **kw) -> tuple[list[int], list[BaseException]]:
    """The first byte of every item delivered, and the errors of those dropped."""
    errors: list[BaseException] = []
    with ds.sampled_batcher(batch_size=2, input_dims=(4,), processor=Raw(), workers="thread",
                            on_error=errors.append, **kw) as b:  # fmt: skip
        got = sorted(int(x[0]) for batch in b for x in batch.input)
    return got, errors


def has_secret(headers: dict) -> bool:
    return "Authorization" in headers or "X-Api-Key" in headers


# ------------------------------------------------------------------ credentials


def test_headers_go_to_the_remote_index_s_origin_not_to_hosts_its_rows_name(tmp_path):
    """Before: every host a remote index (or its meta prefix) named got `headers=`."""
    with recording(tmp_path / "b") as other:
        rows = ["items/0.bin", "items/1.bin", f"{other.url}items/2.bin"]
        www(tmp_path / "b", ["items/3.bin"])  # (B serves items too)
        with recording(www(tmp_path / "a", rows)) as home:
            ds = Dataset(home.url + "train.csv", headers=SECRET,
                         allow_networks=["127.0.0.1"], **FAST)  # fmt: skip
            assert epoch(ds) == ([0, 1, 2], [])
            # named: they go there too
            ds = Dataset(home.url + "train.csv", headers=SECRET, credential_origins=[other.url],
                         allow_networks=["127.0.0.1"], **FAST)  # fmt: skip
            assert epoch(ds) == ([0, 1, 2], [])
    assert all(has_secret(h) for _, h in home.seen)  # the index, its meta file, its items
    first, second = other.headers_for("items/2.bin")
    assert not has_secret(first), "credentials reached a host only the index named"
    assert has_secret(second) and second["Authorization"] == "Bearer s3cret"


def test_a_meta_prefix_elsewhere_gets_no_credentials(tmp_path):
    b = www(tmp_path / "b", [])
    with recording(b) as other, recording(www(tmp_path / "a", ["items/1.bin", "items/3.bin"],
                                              other.url)) as home:  # fmt: skip
        ds = Dataset(home.url + "train.csv", headers=SECRET, allow_networks=["127.0.0.1"],
                     **FAST)  # fmt: skip
        assert epoch(ds) == ([1, 3], [])
    assert all(has_secret(h) for _, h in home.seen)
    assert [p for p, _ in other.seen] == ["items/1.bin", "items/3.bin"]
    assert not any(has_secret(h) for _, h in other.seen)


def test_a_local_index_sends_headers_only_to_the_origins_named(tmp_path):
    """A local index names no origin of its own: headers with none named are refused
    where they are given (before: sent to every host the file named)."""
    with recording(www(tmp_path / "b", [])) as b, recording(www(tmp_path / "a", [])) as a:
        index = tmp_path / "local.csv"
        index.write_text(f"filename\n{a.url}items/0.bin\n{b.url}items/1.bin\n")
        with pytest.raises(ValueError, match=r"would go to no server.*credential_origins="):
            Dataset(str(index), headers=SECRET, **FAST)
        ds = Dataset(str(index), **FAST)
        with pytest.raises(ValueError, match="credential_origins="):
            ds.sampled_batcher(batch_size=2, input_dims=(4,), headers=SECRET)
        ds = Dataset(str(index), headers=SECRET, credential_origins=[a.url.rstrip("/")], **FAST)
        assert epoch(ds) == ([0, 1], [])  # (a local index: its loopback items are fine)
    assert [has_secret(h) for _, h in a.seen] == [True]
    assert [has_secret(h) for _, h in b.seen] == [False]


def test_a_redirect_to_another_origin_drops_the_credentials(tmp_path):
    with recording(None) as other:
        hop = {"items/2.bin": f"{other.url}x"}
        with recording(www(tmp_path / "a", ["items/0.bin", "items/2.bin"]), hop) as home:
            ds = Dataset(home.url + "train.csv", headers=SECRET, redirects="any",
                         allow_networks=["127.0.0.1"], **FAST)  # fmt: skip
            got, errors = epoch(ds)
    assert errors == [] and sorted(got) == [0, ord("s")]  # b"seen" from the other origin
    assert [p for p, _ in other.seen] == ["x"] and not has_secret(other.seen[0][1])


@pytest.mark.parametrize(
    "value, message",
    [("https://host/path", "is not an origin"), ("ftp://host", "is not an origin"),
     ("https://user@host", "is not an origin"), ("host:80", "is not an origin"),
     ("https://host", None), ("http://[::1]:8080/", None)],
)  # fmt: skip
def test_credential_origins_are_checked_where_given(tmp_path, value, message):
    index = www(tmp_path, ["items/0.bin"]) / "train.csv"
    if message is None:
        Dataset(str(index), credential_origins=[value])
        return
    with pytest.raises(ValueError, match=message):
        Dataset(str(index), credential_origins=[value])
    with pytest.raises(TypeError, match="a list of origins"):
        Dataset(str(index), credential_origins="https://host")
    with pytest.raises(TypeError, match="did you mean 'credential_origins'"):
        Dataset(str(index), credential_origin=["https://host"])
    with pytest.raises(ValueError, match="is not an address or network"):
        Dataset(str(index), allow_networks=["10.0.0.0/33"])


# ------------------------------------------------------------------ targets


def refused_rows(port: int) -> list[str]:
    """Rows a hostile remote index might hold naming this host's services, under every
    spelling. (Only this host: were the guard broken, the test would reach nothing else.)"""
    return [
        f"http://127.0.0.1:{port}/a.bin",
        f"http://localhost:{port}/b.bin",  # a name that resolves to loopback
        f"http://[::ffff:127.0.0.1]:{port}/c.bin",  # IPv4 written as IPv6
        f"http://[::1]:{port}/d.bin",
        f"http://0.0.0.0:{port}/g.bin",
    ]


# Rows naming other hosts: the cloud metadata service, the private network. They are
# checked on the scope a remote index gets, before any connection, not fetched: a
# test never sends a packet off this host, even when the code under test is broken.
OFF_HOST_ROWS = {
    "http://169.254.169.254/latest/meta-data/iam/security-credentials/": "a link-local",
    "http://10.255.255.1/e.bin": "a private",
    "http://192.168.0.1/f.bin": "a private",
    "http://[fe80::1]/h.bin": "a link-local",
    "http://[fd00::1]/i.bin": "a private",
}


@pytest.mark.parametrize("workers", ["thread", "process"])
def test_a_remote_index_cannot_send_the_trainer_to_private_addresses(tmp_path, workers):
    """Before: a remote index could have the trainer GET anything reachable from it."""
    with recording(None) as victim:
        rows = ["items/0.bin", *refused_rows(victim.port), "items/1.bin"]
        with recording(www(tmp_path / "a", rows)) as home:
            ds = Dataset(home.url + "train.csv", **FAST)
            errors: list[BaseException] = []
            with ds.sampled_batcher(batch_size=5, input_dims=(4,), processor=Raw(),
                                    workers=workers, num_workers=1, on_error=errors.append,
                                    ) as b:  # fmt: skip
                got = sorted(int(x[0]) for batch in b for x in batch.input)
    assert got == [0, 1]  # the index's own origin is reached
    assert victim.seen == [], "a remote index reached a loopback service"
    assert len(errors) == len(refused_rows(0))
    for err in errors:
        assert isinstance(err, FetchError) and not err.retryable
        assert "refused: the remote index http://127.0.0.1:" in str(err)
        assert "allow_networks=[" in str(err)
    text = " ".join(str(e) for e in errors)
    for kind in ("a loopback", "an unspecified"):
        assert f"{kind} address" in text


def test_a_remote_index_cannot_name_the_metadata_service_or_the_private_network():
    scope = scope_for(["https://data.example.com/train.csv"])
    for url, kind in OFF_HOST_ROWS.items():
        with pytest.raises(TargetRefused, match=f"names .*, {kind} address; .*allow_networks="):
            scope.refuse_literal(url)
    scope.refuse_literal("https://data.example.com/items/0.bin")  # its own origin
    scope.refuse_literal("https://93.184.215.14/items/0.bin")  # a public address
    allowed = scope_for(["https://data.example.com/train.csv"], allow_networks=["10.0.0.0/8"])
    allowed.refuse_literal("http://10.255.255.1/e.bin")
    with pytest.raises(TargetRefused):
        allowed.refuse_literal("http://192.168.0.1/f.bin")


def test_allow_networks_lets_a_remote_index_reach_them(tmp_path):
    with recording(www(tmp_path / "b", [])) as other:
        rows = ["items/0.bin", f"{other.url}items/1.bin",
                f"http://localhost:{other.port}/items/2.bin"]  # fmt: skip
        with recording(www(tmp_path / "a", rows)) as home:
            ds = Dataset(home.url + "train.csv", allow_networks=["127.0.0.0/8"], **FAST)
            assert epoch(ds) == ([0, 1, 2], [])
            # a local copy of the same index is the user's own: no option needed
            (tmp_path / "mine.csv").write_text(
                "filename\n" + "\n".join(f"{home.url}{r}" if "://" not in r else r for r in rows)
            )
            assert epoch(Dataset(str(tmp_path / "mine.csv"), **FAST)) == ([0, 1, 2], [])
    assert sorted(p for p, _ in other.seen) == ["items/1.bin", "items/1.bin", "items/2.bin",
                                                "items/2.bin"]  # fmt: skip


def test_a_redirect_cannot_lead_a_remote_index_s_fetch_to_loopback(tmp_path, caplog):
    with recording(None) as victim:
        hop = {"items/3.bin": f"http://localhost:{victim.port}/admin"}
        with recording(www(tmp_path / "a", ["items/0.bin", "items/3.bin"]), hop) as home:
            ds = Dataset(home.url + "train.csv", redirects="any", **FAST)
            with caplog.at_level(logging.WARNING):
                got, errors = epoch(ds)
    assert got == [0] and victim.seen == []
    assert len(errors) == 1 and "names localhost (127.0.0.1), a loopback address" in str(errors[0])


def test_a_bare_fetcher_is_the_caller_s_own():
    """Fetcher() used directly: each URL is the caller's; headers go to its origin."""
    with recording(None) as a:
        with Fetcher(headers=SECRET, **FAST) as f:
            assert f.read(a.url + "x") == b"seen"
        guarded = scope_for(["http://198.51.100.7/train.csv"], allow_networks=[])
        with Fetcher(scope=guarded, **FAST) as f, pytest.raises(FetchError, match="loopback"):
            f.read(a.url + "y")
    assert [has_secret(h) for _, h in a.seen] == [True]
    assert Scope().sends_credentials("http://h/x", "http://h/y")
    assert not Scope().sends_credentials("http://h:81/x", "http://h/y")
