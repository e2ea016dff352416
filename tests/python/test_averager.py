"""apiary.DecentralizedAverager: two peers average in place (weighted), bad arguments."""
import concurrent.futures
import ctypes
import threading
import time

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


def run_steps(avs, **kw):
    # one background step per averager (hivemind's wait=False), then their results
    ctls = [av.step(wait=False, **kw) for av in avs]
    assert all(isinstance(c, apiary.StepControl) for c in ctls)
    return [c.result(timeout=120) for c in ctls]


def test_two_peers_average_weighted(dhts):
    a, b = dhts
    ta = [torch.tensor([1.0, 2.0, 3.0]), torch.ones(2, 2)]
    tb = [torch.tensor([3.0, 6.0, 7.0]), torch.full((2, 2), 5.0)]
    avs = [apiary.DecentralizedAverager(t, d, prefix="avgtest", target_group_size=2,
                                        min_matchmaking_time=5.0, start=True)
           for t, d in ((ta, a), (tb, b))]
    out = [None, None]

    def run(i, w):
        # hivemind's gather: a's metadata reaches the whole group, b gives none (None)
        out[i] = avs[i].step(weight=w, gather={"samples": 32, "name": "a"} if i == 0 else None)

    ths = [threading.Thread(target=run, args=(0, 1.0)), threading.Thread(target=run, args=(1, 3.0))]
    [t.start() for t in ths]
    [t.join() for t in ths]
    # hivemind's return value: the group, {PeerID: gathered data}, both peers in it
    for o in out:
        assert o == {a.peer_id: {"samples": 32, "name": "a"}, b.peer_id: None}
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
    # no group: None once the timeout is over (retrying meanwhile), or after one attempt
    # with allow_retries=False; the tensors keep their values
    a, _ = dhts
    av = apiary.DecentralizedAverager([torch.ones(3)], a, prefix="alone", min_matchmaking_time=0.5)
    t0 = time.monotonic()
    assert av.step(timeout=1.6) is None
    assert time.monotonic() - t0 >= 1.5  # retried until the deadline, not one 0.5 s search
    assert av.step(allow_retries=False) is None
    with av.get_tensors() as ts:
        assert torch.equal(ts[0], torch.ones(3))
    # timeout=None retries until a group forms (hivemind): cancel() ends it, result None
    # is not given: the future is cancelled
    ctl = av.step(wait=False)
    time.sleep(0.7)
    assert not ctl.done() and ctl.stage == apiary.AveragingStage.LOOKING_FOR_GROUP
    assert ctl.cancel() and ctl.cancelled()
    with pytest.raises(concurrent.futures.CancelledError):
        ctl.result()
    av.shutdown()


def test_background_steps_trigger_and_weights(dhts):
    a, b = dhts
    avs = [apiary.DecentralizedAverager([torch.full((4,), v)], d, prefix="bg",
                                        target_group_size=2, min_matchmaking_time=5.0)
           for v, d in ((1.0, a), (5.0, b))]
    # require_trigger: nothing is averaged before allow_allreduce()
    ctls = [av.step(wait=False, require_trigger=True) for av in avs]
    time.sleep(0.5)
    for c in ctls:
        assert not c.done() and not c.triggered
        assert c.stage == apiary.AveragingStage.AWAITING_TRIGGER
    ctls[0].weight = 3.0  # may change until the round begins (hivemind's StepControl)
    for c in ctls:
        c.allow_allreduce()
    res = [c.result(timeout=120) for c in ctls]
    assert res[0] == res[1] == {a.peer_id: None, b.peer_id: None}
    assert all(c.began_allreduce and c.stage == apiary.AveragingStage.FINISHED for c in ctls)
    for av in avs:
        with av.get_tensors() as ts:
            assert torch.allclose(ts[0], torch.full((4,), 2.0))  # (3*1 + 5) / 4
    for av in avs:
        av.shutdown()


def test_zero_weight_peer(dhts):
    # weight 0 (hivemind: allowed): the peer is in the group, adds nothing, gets the mean
    a, b = dhts
    avs = [apiary.DecentralizedAverager([torch.full((5,), v)], d, prefix="zero",
                                        target_group_size=2, min_matchmaking_time=5.0)
           for v, d in ((7.0, a), (-3.0, b))]
    ctls = [av.step(wait=False, weight=w, timeout=60) for av, w in zip(avs, (0.0, 2.0))]
    res = [c.result(timeout=120) for c in ctls]
    assert res[0] == res[1] == {a.peer_id: None, b.peer_id: None}
    for av in avs:
        with av.get_tensors() as ts:
            assert torch.equal(ts[0], torch.full((5,), -3.0))
    for av in avs:
        av.shutdown()


def test_compression_and_roles(dhts):
    a, b = dhts
    third = 1.0 / 3.0
    fp16 = apiary.Float16Compression()
    avs = [apiary.DecentralizedAverager([torch.full((8,), third)], d, prefix="c16",
                                        target_group_size=2, compression=fp16)
           for d in (a, b)]
    res = run_steps(avs)
    assert all(r is not None for r in res)
    with avs[0].get_tensors() as ts:
        # the round travelled as halves: 1/3 comes back rounded to fp16, not exact
        assert torch.allclose(ts[0], torch.full((8,), third), atol=1e-3)
        assert not torch.equal(ts[0], torch.full((8,), third))
        assert torch.equal(ts[0], torch.full((8,), third).half().float())
    for av in avs:
        av.shutdown()
    # an auxiliary peer joins the group, averages nothing of its own; its default weight
    # is 0 and its tensors are not the group's
    avs = [apiary.DecentralizedAverager([torch.full((2,), v)], d, prefix="aux",
                                        target_group_size=2, auxiliary=aux)
           for v, d, aux in ((4.0, a, False), (0.0, b, True))]
    assert avs[1].mode == "aux" and avs[0].mode == "node"
    from apiary import _lib as C
    m = C.AvgMember()
    C.lib().ap_averager_member(avs[1]._av, ctypes.byref(m))
    assert m.role == C.AP_AVG_AUX
    res = run_steps(avs)
    assert res[0] == res[1] == {a.peer_id: None, b.peer_id: None}
    with avs[0].get_tensors() as ts:
        assert torch.equal(ts[0], torch.full((2,), 4.0))
    for av in avs:
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
    for exc, match, kw in [
        (TypeError, "min_matchmaking_time", dict(min_matchmaking_time="5")),
        (ValueError, "min_matchmaking_time", dict(min_matchmaking_time=0)),
        (TypeError, "compression", dict(compression="fp16")),
        (ValueError, "allreduce_timeout", dict(allreduce_timeout=-1)),
        (ValueError, "auxiliary", dict(auxiliary=True, client_mode=True)),
    ]:
        with pytest.raises(exc, match=match):
            apiary.DecentralizedAverager(t, a, prefix="bad", **kw)
    av = apiary.DecentralizedAverager(t, a, prefix="bad")
    for exc, match, kw in [
        (ValueError, "weight", dict(weight=-1)),
        (ValueError, "weight", dict(weight=float("nan"))),
        (TypeError, "weight", dict(weight="1")),
        (ValueError, "gather", dict(gather=b"x" * 600)),
        (TypeError, "gather", dict(gather=object())),
        (ValueError, "require_trigger", dict(require_trigger=True)),
        (TypeError, "wait", dict(wait=1)),
        (ValueError, "timeout", dict(timeout=0)),
        (TypeError, "timeout", dict(timeout="1")),
        (TypeError, "scheduled_time", dict(scheduled_time="now")),
        (ValueError, "scheduled_time", dict(scheduled_time=apiary.get_dht_time() + 60,
                                            timeout=1)),
    ]:
        with pytest.raises(exc, match=match):
            av.step(**kw)
    ctl = av.step(wait=False, allow_retries=False, timeout=0.5)
    with pytest.raises(ValueError, match="weight"):
        ctl.weight = -2
    assert ctl.result(timeout=60) is None
    av.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        av.step()
