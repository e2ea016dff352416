"""apiary.DecentralizedAverager: two peers average in place (weighted), bad arguments."""
import threading

import pytest

torch = pytest.importorskip("torch", reason="python3-torch is not installed")

import apiary  # noqa: E402

LOOP = ["/ip4/127.0.0.1/tcp/0"]


@pytest.fixture
def dhts():
    a = apiary.DHT(host_maddrs=LOOP)
    b = apiary.DHT(initial_peers=a.get_visible_maddrs(), host_maddrs=LOOP)
    yield a, b
    b.shutdown()
    a.shutdown()


def test_two_peers_average_weighted(dhts):
    a, b = dhts
    ta = [torch.tensor([1.0, 2.0, 3.0]), torch.ones(2, 2)]
    tb = [torch.tensor([3.0, 6.0, 7.0]), torch.full((2, 2), 5.0)]
    avs = [apiary.DecentralizedAverager(t, d, prefix="avgtest", target_group_size=2,
                                        min_matchmaking_time=5.0, start=True)
           for t, d in ((ta, a), (tb, b))]
    out = [None, None]

    def run(i, w):
        out[i] = avs[i].step(weight=w)

    ths = [threading.Thread(target=run, args=(0, 1.0)), threading.Thread(target=run, args=(1, 3.0))]
    [t.start() for t in ths]
    [t.join() for t in ths]
    assert out[0] is not None and len(out[0]) == 2 and out[1] is not None
    for av in avs:
        with av.get_tensors() as ts:
            assert torch.allclose(ts[0], torch.tensor([2.5, 5.0, 6.0]))
            assert torch.allclose(ts[1], torch.full((2, 2), 4.0))
            ptr = ts[0].data_ptr()
        with av.get_tensors() as ts:
            assert ts[0].data_ptr() == ptr  # the same buffer every time: no copies
    # the caller's tensors were copied in, not aliased
    assert torch.equal(ta[0], torch.tensor([1.0, 2.0, 3.0]))
    for av in avs:
        av.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        avs[0].step()


def test_alone_no_group(dhts):
    a, _ = dhts
    av = apiary.DecentralizedAverager([torch.ones(3)], a, prefix="alone", min_matchmaking_time=0.5)
    assert av.step() is None
    with av.get_tensors() as ts:
        assert torch.equal(ts[0], torch.ones(3))
    av.shutdown()


def test_bad_arguments(dhts):
    a, _ = dhts
    t = [torch.ones(3)]
    for exc, match, kw in [
        (TypeError, "dht", dict(dht="x")),
        (TypeError, "prefix", dict(prefix=1)),
        (ValueError, "prefix", dict(prefix="")),
        (TypeError, "target_group_size", dict(target_group_size="2")),
        (ValueError, "target_group_size", dict(target_group_size=1)),
        (TypeError, "averaged_tensors\\[0\\]", dict(averaged_tensors=[3])),
        (TypeError, "floating", dict(averaged_tensors=[torch.ones(2, dtype=torch.int64)])),
        (ValueError, "on meta", dict(averaged_tensors=[torch.ones(2, device="meta")])),
        (ValueError, "empty", dict(averaged_tensors=[])),
        (TypeError, "unexpected keyword", dict(bogus=1)),
    ]:
        args = dict(averaged_tensors=t, dht=a, prefix="bad")
        args.update(kw)
        with pytest.raises(exc, match=match):
            apiary.DecentralizedAverager(**args)
    av = apiary.DecentralizedAverager(t, a, prefix="bad")
    with pytest.raises(ValueError, match="weight"):
        av.step(weight=-1)
    with pytest.raises(TypeError, match="weight"):
        av.step(weight="1")
    av.shutdown()
