"""The fault-injecting proxy in front of the GCS emulator (``fault_proxy.FaultProxy``): what it
passes through is what the emulator answers (its own address in place of the emulator's), and
each fault does what the storage tests rely on: 503/429 answered without reaching the
emulator, resets and refusals seen by the client as connection errors, stalls as a slow server,
on a seeded share of the requests."""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
import uuid

import pytest

from fault_proxy import FaultProxy


@pytest.fixture
def proxy(gcs_server):
    with FaultProxy(gcs_server.url, seed=0) as p:
        yield p


@pytest.fixture
def name(bucket):
    return bucket.removeprefix("gs://")


def request(url, method, path, body=None, headers=None):
    """One request on a new connection: (status, headers, body)."""
    parsed = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def upload(url, bucket, obj, data):
    q = urllib.parse.urlencode({"uploadType": "media", "name": obj})
    return request(url, "POST", f"/upload/storage/v1/b/{bucket}/o?{q}", data)


def download(url, bucket, obj):
    return request(url, "GET", f"/download/storage/v1/b/{bucket}/o/{obj}?alt=media")


def netloc(url):
    return url.removeprefix("http://").encode()


def test_pass_through_is_the_emulators_answer_with_the_proxys_address(proxy, gcs_server, name):
    # object data is passed as it is, even where it holds the emulator's address
    data = b"bytes naming " + netloc(gcs_server.url) + bytes(range(256))
    status, _, _ = upload(proxy.url, name, "x", data)
    assert status == 200
    assert download(proxy.url, name, "x")[2] == data == download(gcs_server.url, name, "x")[2]
    # JSON answers: the emulator's bytes, its address replaced by the proxy's
    path = f"/storage/v1/b/{name}/o"
    direct, through = request(gcs_server.url, "GET", path), request(proxy.url, "GET", path)
    assert through[0] == direct[0] == 200
    assert netloc(gcs_server.url) in direct[2]
    assert through[2] == direct[2].replace(netloc(gcs_server.url), netloc(proxy.url))
    assert json.loads(through[2])["items"][0]["name"] == "x"
    assert proxy.requests == 3 and proxy.injected == 0


def test_a_bucket_and_a_resumable_upload_go_through_the_proxy(proxy, gcs_server):
    new = f"diffjax-test-{uuid.uuid4().hex[:12]}"
    body = json.dumps({"name": new}).encode()
    headers = {"Content-Type": "application/json"}
    assert request(proxy.url, "POST", "/storage/v1/b?project=test", body, headers)[0] == 200
    q = urllib.parse.urlencode({"uploadType": "resumable", "name": "r"})
    status, h, _ = request(proxy.url, "POST", f"/upload/storage/v1/b/{new}/o?{q}", b"{}", headers)
    assert status == 200
    location = h["Location"]
    assert location.startswith(proxy.url + "/"), location  # the client stays on the proxy
    data = b"resumable " * 1000
    status, _, _ = request(proxy.url, "PUT", location.removeprefix(proxy.url), data)
    assert status == 200
    assert download(gcs_server.url, new, "r")[2] == data


def test_503_on_every_request_never_reaches_the_emulator(proxy, gcs_server, name):
    proxy.set("503", rate=1.0)
    for i in range(5):
        status, h, body = upload(proxy.url, name, f"o{i}", b"data")
        assert status == 503
        assert json.loads(body)["error"]["code"] == 503
    assert proxy.injected == proxy.requests == 5
    assert request(gcs_server.url, "GET", f"/storage/v1/b/{name}/o")[2].count(b'"name"') == 0
    proxy.set("429", rate=1.0)
    status, _, body = request(proxy.url, "GET", f"/storage/v1/b/{name}/o")
    assert status == 429 and json.loads(body)["error"]["code"] == 429


def test_a_rate_hits_a_seeded_share_of_the_requests(gcs_server, name):
    def statuses(seed):
        with FaultProxy(gcs_server.url, seed=seed) as p:
            p.set("503", rate=0.5)
            got = [request(p.url, "GET", f"/storage/v1/b/{name}/o")[0] for _ in range(40)]
            assert p.injected == got.count(503) and p.requests == 40
            return got

    first = statuses(0)
    assert set(first) == {200, 503}
    assert 12 <= first.count(503) <= 28
    assert statuses(0) == first  # the same seed, the same requests hit
    assert statuses(1) != first


def test_a_reset_is_a_connection_error(proxy, name):
    proxy.set("reset", rate=1.0)
    with pytest.raises(ConnectionError):
        request(proxy.url, "GET", f"/storage/v1/b/{name}/o")
    assert proxy.injected == 1
    proxy.set(None)
    assert request(proxy.url, "GET", f"/storage/v1/b/{name}/o")[0] == 200


def test_a_stall_delays_the_answer_and_keeps_it(proxy, gcs_server, name):
    data = b"slow but right"
    assert upload(gcs_server.url, name, "s", data)[0] == 200
    proxy.set("stall", rate=1.0, stall_s=1.0)
    start = time.monotonic()
    status, _, body = download(proxy.url, name, "s")
    assert time.monotonic() - start >= 1.0
    assert (status, body) == (200, data)


def test_down_for_refuses_then_recovers(proxy, name):
    proxy.down_for(1.0)
    start = time.monotonic()
    with pytest.raises(ConnectionError):
        request(proxy.url, "GET", f"/storage/v1/b/{name}/o")
    assert time.monotonic() - start < 1.0
    time.sleep(1.2)
    assert request(proxy.url, "GET", f"/storage/v1/b/{name}/o")[0] == 200
    assert proxy.injected == 1


def test_down_after_passes_until_the_named_request_is_answered(proxy, gcs_server, name):
    proxy.down_after("dir/commit_success.txt")
    assert upload(proxy.url, name, "dir/a.bin", b"a")[0] == 200
    assert download(proxy.url, name, "dir%2Fcommit_success.txt")[0] == 404  # a read: no trigger
    assert not proxy.triggered.is_set()
    assert upload(proxy.url, name, "dir/commit_success.txt", b"ok")[0] == 200  # answered
    assert proxy.triggered.is_set()
    with pytest.raises(ConnectionError):
        request(proxy.url, "GET", f"/storage/v1/b/{name}/o")
    assert gcs_server.objects(f"gs://{name}/dir") == {"a.bin": b"a", "commit_success.txt": b"ok"}
    proxy.set(None)
    assert request(proxy.url, "GET", f"/storage/v1/b/{name}/o")[0] == 200


def test_the_settings_are_checked(proxy):
    with pytest.raises(ValueError, match="fault kind"):
        proxy.set("500")
    with pytest.raises(ValueError, match="rate"):
        proxy.set("503", rate=2.0)
    with pytest.raises(ValueError, match="plain HTTP"):
        FaultProxy("https://storage.googleapis.com")


def test_gcsfs_reads_and_writes_through_the_proxy_and_retries_its_503s(
    proxy, gcs_server, name, monkeypatch
):
    import gcsfs.core

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
    # endpoint_url: fsspec applies its config to every instance, and diffjax.infra.storage puts the
    # emulator it was configured for there
    fs = gcsfs.core.GCSFileSystem(token="anon", endpoint_url=proxy.url, skip_instance_cache=True)
    data = bytes(range(256)) * 2400  # 600 KiB: a resumable upload in 256 KiB chunks
    with fs.open(f"{name}/f.bin", "wb", block_size=256 * 1024) as f:
        f.write(data)
    assert download(gcs_server.url, name, "f.bin")[2] == data
    assert fs.cat_file(f"{name}/f.bin") == data
    seen = proxy.requests
    proxy.set("503", rate=0.3)
    for _ in range(4):
        assert fs.cat_file(f"{name}/f.bin") == data
    assert proxy.injected > 0 and proxy.requests > seen + 4


def test_the_log_names_each_request_and_a_multipart_uploads_object(proxy, gcs_server, name):
    """The proxy's log (the storage benchmark counts requests by what they were for from it):
    each request's method and path, and for a multipart upload, whose object name travels in
    the body, ``&name=OBJECT`` added."""
    boundary = "b0undary"
    meta = json.dumps({"name": "run/metrics.jsonl"})
    body = (
        f"--{boundary}\r\nContent-Type: application/json\r\n\r\n{meta}\r\n"
        f"--{boundary}\r\nContent-Type: application/octet-stream\r\n\r\nline\n\r\n--{boundary}--\r\n"
    ).encode()
    path = f"/upload/storage/v1/b/{name}/o?uploadType=multipart"
    headers = {"Content-Type": f"multipart/related; boundary={boundary}"}
    assert request(proxy.url, "POST", path, body, headers)[0] == 200
    assert download(proxy.url, name, "run%2Fmetrics.jsonl")[0] == 200
    assert proxy.log == [
        ("POST", f"{path}&name=run/metrics.jsonl"),
        ("GET", f"/download/storage/v1/b/{name}/o/run%2Fmetrics.jsonl?alt=media"),
    ]
    assert gcs_server.objects(f"gs://{name}/run") == {"metrics.jsonl": b"line\n"}
