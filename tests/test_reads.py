"""Every read of the world (index, meta, .pt, listings, parts, items) under one policy,
and the bounds on what a server may send, against a real fault-injecting server."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pickle
import socket

import pytest
import torch
import webdataset as wds

from distlearn.dataset import BadIndex, Dataset, FetchError, IndexNotFound, PartError
from distlearn.dataset.fetch.fetcher import Fetcher
from distlearn.dataset.index.parts import SampleMember
from distlearn.dataset.processors import Raw
from tests.faulty_server import running

FAST = dict(backoff=0.01, timeout=5.0)


@pytest.fixture
def www(tmp_path):
    """A folder to serve: an index of 6 raw items, a .pt index, 3 tar shards."""
    root = tmp_path / "www"
    (root / "items").mkdir(parents=True)
    rows = ["filename,label"]
    for i in range(6):
        (root / "items" / f"{i}.bin").write_bytes(bytes([i]) * 4)
        rows.append(f"items/{i}.bin,{'ab'[i % 2]}")
    (root / "train.csv").write_text("\n".join(rows) + "\n")
    torch.save({"x": torch.arange(8.0).view(4, 2), "y": torch.tensor([0, 1, 0, 1])},
               root / "d.pt")  # fmt: skip
    (root / "shards").mkdir()
    for p in range(3):
        with wds.TarWriter(str(root / "shards" / f"s-{p}.tar")) as sink:
            for i in range(4):
                sink.write({"__key__": f"{p}-{i}", "bin": bytes([p * 4 + i]) * 4})
    return root


@contextlib.contextmanager
def serve(root, plan=None, stall=5.0):
    with running(root, plan, stall) as (base, hits):
        yield base, hits


def raw_epoch(ds, **kw) -> list[int]:
    with ds.sampled_batcher(batch_size=4, input_dims=(4,), processor=Raw(), workers="thread",
                            **kw) as b:  # fmt: skip
        return sorted(int(x[0]) for batch in b for x in batch.input)


def test_index_meta_and_pt_reads_are_retried(www):
    plan = {"train.csv": ["503", "cut", "ok"], "train-meta.csv": ["500", "404"],
            "d.pt": ["429", "ok"]}  # fmt: skip
    with serve(www, plan) as (base, hits):
        ds = Dataset(base + "train.csv", **FAST)
        assert len(ds) == 6 and raw_epoch(ds) == list(range(6))
        assert len(Dataset(base + "d.pt", **FAST)) == 4
        counts = hits()
    assert counts["train.csv"] == 3 and counts["d.pt"] == 2
    assert counts["train-meta.csv"] == 2, "a 500 is retried, a 404 means no meta file"


def test_404_is_final_and_errors_name_the_url(www):
    with serve(www, {"train.csv": ["404"], "gone.csv": ["503"]}) as (base, hits):
        with pytest.raises(IndexNotFound, match=r"index not found: http://127.*/train\.csv"):
            Dataset(base + "train.csv", **FAST)
        with pytest.raises(FetchError, match=r"/gone\.csv: HTTP 503 .*\(after 3 tries\)"):
            Dataset(base + "gone.csv", retries=2, **FAST)
        counts = hits()
    assert counts["train.csv"] == 1 and counts["gone.csv"] == 3
    # a server that is down: the URL is in the message, not just "Connection refused"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/train.csv"
    with pytest.raises(FetchError, match=rf"{dead}: ClientConnectorError.*after 2 tries"):
        Dataset(dead, retries=1, **FAST)


def test_part_listing_and_part_downloads_are_retried(www, caplog):
    plan = {"shards/": ["503", "ok"], "shards/s-1.tar": ["500", "cut", "ok"],
            "shards/s-2.tar": ["404"]}  # fmt: skip
    with serve(www, plan) as (base, hits):
        ds = Dataset(base + "shards/", cache_parts=False, **FAST)
        assert [p.rsplit("/", 1)[1] for p in ds.index.parts] == ["s-0.tar", "s-1.tar", "s-2.tar"]
        bin_member = SampleMember(Raw(), ["bin"])
        with ds.sampled_batcher(batch_size=4, input_dims=(4,), processor=bin_member,
                                workers="thread") as b:  # fmt: skip
            got = sorted(int(x[0]) for batch in b for x in batch.input)
            stats = b.stats
        counts = hits()
    assert got == list(range(8)), "s-2.tar is missing: skipped, not retried"
    assert (
        counts["shards/"] == 2 and counts["shards/s-1.tar"] == 3 and counts["shards/s-2.tar"] == 1
    )
    assert stats["failed_parts"] == 1 and "s-2.tar" in caplog.text


def test_a_folder_url_suggests_an_index_file(www, serve_dir):
    index_files = r"holds index files \(train\.csv, d\.pt\).*Dataset\('{}train\.csv'\)"
    with serve(www) as (base, _), pytest.raises(PartError, match=index_files.format(base)):
        Dataset(base, **FAST)  # a server with listings: name the index files it holds
    plain = serve_dir(www)  # dataset.serve has no listings
    with pytest.raises(PartError, match=r"brace pattern .* name the index file"):
        Dataset(plain, **FAST)


def test_body_cap_with_and_without_content_length(www):
    (www / "big.bin").write_bytes(bytes(5000))
    with serve(www, {"endless.bin": ["endless"]}) as (base, hits):
        with Fetcher(max_item_bytes=1000, **FAST) as f:
            with pytest.raises(FetchError, match="5000 bytes exceeds max_item_bytes=1000"):
                f.read(base + "big.bin")
            with pytest.raises(FetchError, match="exceeds max_item_bytes=1000"):
                f.read(base + "endless.bin")
        counts = hits()
    assert counts["big.bin"] == 1 and counts["endless.bin"] == 1, "a body too large is final"
    assert counts["endless.bin#sent"] < 64 << 20, "the endless body was dropped, not drained"


def test_a_server_that_ignores_range_is_read_to_the_record_only(www, caplog):
    big = os.urandom(64 << 20)
    (www / "shard.bin").write_bytes(big)
    (www / "records.csv").write_text("filename,offset,length\nshard.bin,10,4\nshard.bin,1000,4\n")
    with serve(www, {"shard.bin": ["norange"]}) as (base, hits):
        ds = Dataset(base + "records.csv", **FAST)
        with ds.sampled_batcher(batch_size=2, input_dims=(4,), processor=Raw(), workers="thread",
                                pool_size=1) as b:  # fmt: skip
            rows = b.next_batch().input.tolist()
        counts = hits()
    assert sorted(rows) == sorted([list(big[10:14]), list(big[1000:1004])])
    assert counts["shard.bin"] == 2
    assert counts["shard.bin#sent"] < 32 << 20, "the connection was dropped after the record"
    assert "ignores HTTP Range" in caplog.text


def test_a_hash_in_a_file_name_is_part_of_the_url_not_a_fragment(www):
    """`img#1.bin` fetched `img` over HTTP (the rest was a fragment, never sent): another
    file's bytes, or a 404, where the same index read from disk was right."""
    (www / "items" / "h#1.bin").write_bytes(b"HASH")
    (www / "items" / "h").write_bytes(b"ELSE")
    (www / "hash.csv").write_text("filename\nitems/h#1.bin\n")
    (www / "meta.csv").write_text("filename\nh#1.bin\n")
    (www / "meta-meta.csv").write_text("hostname\n{base}items\n")
    for index in ("hash.csv", "meta.csv"):
        with serve(www) as (base, _):
            meta = (www / "meta-meta.csv").read_text()
            (www / "meta-meta.csv").write_text(meta.replace("{base}", base))
            assert raw_epoch(Dataset(base + index, **FAST)) == [ord("H")]
            (www / "meta-meta.csv").write_text(meta)
    assert raw_epoch(Dataset(str(www / "hash.csv"))) == [ord("H")]  # as from disk


def test_a_403_for_the_optional_meta_file_reads_as_absent(www):
    """S3 without ListBucket and CloudFront answer 403 for a key that does not exist:
    the index itself could not be opened for want of an optional meta file."""
    with serve(www, {"train-meta.csv": ["403"], "index-meta.csv": ["403"]}) as (base, _):
        assert len(Dataset(base + "train.csv", **FAST)) == 6
    with (
        serve(www, {"m.csv": ["403"]}) as (base, _),  # one named: it must be read
        pytest.raises(FetchError, match="403"),
    ):
        Dataset(base + "train.csv", meta=base + "m.csv", **FAST)


def test_a_local_item_is_bounded_before_it_is_read(tmp_path):
    """A local item was read whole before max_item_bytes applied (a 400 MB file took
    400 MB, /dev/zero ran out of memory), and a FIFO blocked the fetch loop."""
    import resource

    huge = tmp_path / "huge.bin"
    with open(huge, "wb") as f:
        f.truncate(400 << 20)  # sparse: 400 MB to read, none on disk
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    with Fetcher(max_item_bytes=1000, **FAST) as f:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        with pytest.raises(FetchError, match="larger than max_item_bytes=1000"):
            f.read(str(huge))
        assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100 << 10  # KiB
        for special in (str(pipe), "/dev/zero"):
            with pytest.raises(FetchError, match="not a regular file"):
                f.read(special)
        with pytest.raises(FetchError, match="a record of 5000 bytes exceeds"):
            f.read((str(huge), 0, 5000))


def test_redirects_stay_on_the_same_host_unless_allowed(www):
    plan = {"here.bin": ["redirect:/items/1.bin"],
            "away.bin": ["redirect:http://localhost:{port}/items/2.bin"]}  # fmt: skip
    with serve(www, plan) as (base, _):
        with Fetcher(**FAST) as f:
            assert f.read(base + "here.bin") == bytes([1]) * 4
            with pytest.raises(FetchError, match=r"another host than 127\.0\.0\.1"):
                f.read(base + "away.bin")
        with Fetcher(redirects="any", **FAST) as f:
            assert f.read(base + "away.bin") == bytes([2]) * 4
        with Fetcher(redirects="none", **FAST) as f, pytest.raises(FetchError, match="'none'"):
            f.read(base + "here.bin")


@contextlib.contextmanager
def header_recorder():
    """A plain HTTP server on 127.0.0.1 that answers every GET with 4 bytes and keeps
    the headers of each request."""
    import http.server
    import threading

    seen: list[dict] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(dict(self.headers))
            self.send_response(200)
            self.send_header("Content-Length", "4")
            self.end_headers()
            self.wfile.write(b"seen")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/", seen
    finally:
        server.shutdown()
        server.server_close()


def test_headers_go_to_the_origin_asked_for_not_where_a_redirect_leads(www):
    """Credentials in `headers=` reach the URL's own origin; a redirect to another port
    of the same host (another service: same-host lets it through) or to another host
    gets the request without them, as requests and browsers do."""
    secret = {"Authorization": "Bearer s3cret", "X-Api-Key": "k"}
    with header_recorder() as (other, seen):
        port = other.rsplit(":", 1)[1].rstrip("/")
        plan = {"port.bin": [f"redirect:http://127.0.0.1:{port}/x"],
                "host.bin": [f"redirect:http://localhost:{port}/x"]}  # fmt: skip
        with serve(www, plan) as (base, _):
            with Fetcher(headers=secret, **FAST) as f:
                assert f.read(other + "direct") == b"seen"
                assert f.read(base + "port.bin") == b"seen"
            with Fetcher(headers=secret, redirects="any", **FAST) as f:
                assert f.read(base + "host.bin") == b"seen"
    direct, via_port, via_host = seen
    assert direct["Authorization"] == "Bearer s3cret" and direct["X-Api-Key"] == "k"
    for redirected in (via_port, via_host):
        assert "Authorization" not in redirected and "X-Api-Key" not in redirected
        assert redirected["Accept-Encoding"] == "identity"


def test_same_host_redirects_never_go_from_https_to_http():
    f = Fetcher(**FAST)

    class Resp:
        status = 302
        headers = {"Location": "http://example.invalid/x"}

    with pytest.raises(FetchError, match="from https to plain http"):
        f._redirect("https://example.invalid/a", "https://example.invalid/a", Resp())
    assert f._redirect("http://example.invalid/a", "http://example.invalid/a", Resp())


@pytest.mark.parametrize(
    "row, kind",
    [("file:///etc/passwd", "a local path"), ("/etc/passwd", None),
     ("s3://bucket/key.bin", "a s3:// URL")],
)  # fmt: skip
def test_an_http_index_cannot_send_the_trainer_elsewhere(www, row, kind):
    (www / "evil.csv").write_text(f"filename\nitems/0.bin\n{row}\n")
    with serve(www) as (base, _):
        if kind is None:  # a leading slash is the root of the index's own host
            assert Dataset(base + "evil.csv").index.source(0) == base + "etc/passwd"
            return
        with pytest.raises(BadIndex, match=rf"evil\.csv:3: names .*{kind}.*allow_schemes"):
            Dataset(base + "evil.csv")
        scheme = "file" if row.startswith("file") else "s3"
        ds = Dataset(base + "evil.csv", allow_schemes=[scheme])
        assert row in ds.index.sources
    # a meta file cannot do it either
    (www / "evil.csv").write_text("filename\npasswd\n")
    (www / "evil-meta.csv").write_text("hostname\n/etc\n")
    with serve(www) as (base, _), pytest.raises(BadIndex, match="a local path"):
        Dataset(base + "evil.csv")


class _Payload:
    """Runs a shell command when unpickled: what a hostile .pt file carries."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_hostile_pt_index_runs_nothing(www, tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save({"x": torch.zeros(2, 2), "evil": _Payload(marker)}, buf)
    (www / "evil.pt").write_bytes(buf.getvalue())
    pickle.loads(pickle.dumps(_Payload(tmp_path / "check")))  # the payload is real
    assert (tmp_path / "check").exists()
    with serve(www) as (base, hits):
        with pytest.raises(BadIndex, match=r"evil\.pt: not a loadable tensor file"):
            Dataset(base + "evil.pt", **FAST)
        assert not marker.exists()
        monkeypatch.setattr(torch, "__version__", "2.5.1+cpu")  # weights_only was unsafe
        with pytest.raises(BadIndex, match=r"needs torch >= 2\.6"):
            Dataset(base + "d.pt", **FAST)
        counts = hits()
    assert counts["d.pt"] == 0, "refused before it was downloaded"


def test_item_reads_cap_and_log(www, caplog):
    (www / "items" / "3.bin").write_bytes(bytes(10_000))
    with serve(www) as (base, _):
        ds = Dataset(base + "train.csv", max_item_bytes=100, **FAST)
        caplog.set_level(logging.WARNING, logger="distlearn.dataset")
        assert raw_epoch(ds) == [0, 1, 2, 4, 5]  # item 3 dropped, the epoch goes on
    assert "3.bin: body of 10000 bytes exceeds max_item_bytes=100" in caplog.text
