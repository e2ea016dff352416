"""apiary.DHT: Python peers with each other and with C peers (`apiary dht`), bad arguments."""
import subprocess
import threading

import pytest

import apiary
from conftest import apiary_bin

LOOP = ["/ip4/127.0.0.1/tcp/0"]


@pytest.fixture
def pair():
    a = apiary.DHT(host_maddrs=LOOP, start=True)
    b = apiary.DHT(initial_peers=a.get_visible_maddrs(), host_maddrs=LOOP, start=True)
    yield a, b
    b.shutdown()
    a.shutdown()


def test_identity_and_addresses(pair):
    a, b = pair
    assert str(a.peer_id).startswith("12D3KooW")
    assert a.peer_id != b.peer_id
    addrs = a.get_visible_maddrs()
    assert addrs and all(x.startswith("/ip4/127.0.0.1/tcp/") and x.endswith(str(a.peer_id))
                         for x in addrs)


def test_store_get_objects(pair):
    a, b = pair
    t = apiary.get_dht_time()
    assert a.store("k1", {"x": [1, 2.5, "s"], "b": b"\x00\x01"}, t + 30)
    got = b.get("k1", latest=True)
    assert isinstance(got, apiary.ValueWithExpiration)
    assert got.value == {"x": [1, 2.5, "s"], "b": b"\x00\x01"}
    assert abs(got.expiration_time - (t + 30)) < 0.01
    assert b.get("missing-key") is None
    # newest expiration wins; an older one is refused
    assert b.store("k1", "newer", t + 40)
    assert not a.store("k1", "older", t + 35)
    assert a.get("k1", latest=True).value == "newer"


def test_subkeys(pair):
    a, b = pair
    t = apiary.get_dht_time()
    assert a.store("dict", 1, t + 30, subkey="one")
    assert b.store("dict", 2, t + 31, subkey="two")
    got = a.get("dict", latest=True)
    assert {k: v.value for k, v in got.value.items()} == {"one": 1, "two": 2}
    assert got.expiration_time == pytest.approx(t + 31, abs=0.01)


def test_threads_share_a_node(pair):
    a, b = pair
    t = apiary.get_dht_time()
    errs = []

    def work(i):
        try:
            assert a.store("thr%d" % i, i, t + 30)
            assert b.get("thr%d" % i, latest=True).value == i
        except Exception as e:  # noqa
            errs.append(e)

    ths = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    [th.start() for th in ths]
    [th.join() for th in ths]
    assert not errs


def test_c_peers_share_the_dht(c_peer):
    """A Python peer joins through a C node; a C client reads what Python stored and Python
    reads what the C client stored (raw bytes: not msgpack)."""
    d = apiary.DHT(initial_peers=[c_peer.addr], host_maddrs=LOOP)
    try:
        t = apiary.get_dht_time()
        assert d.store("from-python", b"payload", t + 60)
        out = subprocess.run([apiary_bin(), "dht", "get", "from-python", "--latest",
                              "--initial-peers", c_peer.addr], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        # msgpack of b"payload": bin8 header c4 07
        assert "0xc407" + b"payload".hex() in out.stdout
        out = subprocess.run([apiary_bin(), "dht", "store", "from-c", "hello from C", "--ttl",
                              "60", "--initial-peers", c_peer.addr], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        got = d.get("from-c", latest=True)
        assert got is not None and got.value == b"hello from C"
    finally:
        d.shutdown()


def test_client_mode(pair):
    a, _ = pair
    c = apiary.DHT(initial_peers=a.get_visible_maddrs(), client_mode=True)
    try:
        assert c.get_visible_maddrs() == []
        assert c.store("from-client", 7, apiary.get_dht_time() + 30)
        assert a.get("from-client", latest=True).value == 7
    finally:
        c.shutdown()


def test_identity_path(tmp_path):
    p = str(tmp_path / "id.key")
    a = apiary.DHT(host_maddrs=LOOP, identity_path=p)
    pid = a.peer_id
    a.shutdown()
    b = apiary.DHT(host_maddrs=LOOP, identity_path=p)
    assert b.peer_id == pid
    b.shutdown()
    bad = tmp_path / "bad.key"
    bad.write_bytes(b"not a key")
    bad.chmod(0o600)
    with pytest.raises(ValueError, match="identity_path"):
        apiary.DHT(host_maddrs=LOOP, identity_path=str(bad))


def test_bad_arguments(pair):
    a, _ = pair
    t = apiary.get_dht_time()
    with pytest.raises(TypeError, match="key"):
        a.store(None, 1, t + 10)
    with pytest.raises(TypeError, match="key"):
        a.get(object())
    with pytest.raises(ValueError, match="key must be"):
        a.store("", 1, t + 10)
    with pytest.raises(ValueError, match="key must be"):
        a.get("x" * 2000)
    with pytest.raises(TypeError, match="expiration_time"):
        a.store("k", 1, "soon")
    with pytest.raises(ValueError, match="finite"):
        a.store("k", 1, float("nan"))
    with pytest.raises(TypeError, match="msgpack"):
        a.store("k", object(), t + 10)
    with pytest.raises(ValueError, match="limit"):
        a.store("k", b"x" * 70000, t + 10)
    with pytest.raises(ValueError, match="lifetime"):
        a.store("k", 1, t + 10 * 86400)
    with pytest.raises(TypeError, match="latest"):
        a.get("k", latest="yes")
    with pytest.raises(ValueError, match="multiaddr"):
        apiary.DHT(initial_peers=["localhost:1234"])
    with pytest.raises(TypeError, match="unexpected keyword"):
        apiary.DHT(no_such_option=1)
    with pytest.raises(ValueError):
        apiary.DHT(host_maddrs=["/ip4/999.1.1.1/tcp/0"])
    with pytest.raises(apiary.ApiaryError):
        apiary.DHT(initial_peers=["/ip4/127.0.0.1/tcp/1/p2p/%s" % a.peer_id], host_maddrs=LOOP)


def test_after_shutdown():
    d = apiary.DHT(host_maddrs=LOOP)
    d.shutdown()
    d.shutdown()
    for call in (lambda: d.get("k"), lambda: d.store("k", 1, apiary.get_dht_time() + 5),
                 lambda: d.peer_id, d.get_visible_maddrs):
        with pytest.raises(RuntimeError, match="shut down"):
            call()
