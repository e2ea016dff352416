"""The ctypes mirrors of libapiary's structures match the C layout: the C default
functions write the documented defaults where ctypes expects them and nothing past
the end (a header change that moves a field fails here, not in a training run)."""
import ctypes

from apiary import _lib as C


def filled(struct, fn):
    size = ctypes.sizeof(struct)
    buf = (ctypes.c_uint8 * (size + 64))(*([0xA5] * (size + 64)))
    fn(ctypes.cast(buf, ctypes.POINTER(struct)))
    assert bytes(buf[size:]) == b"\xa5" * 64, "the C function wrote past the ctypes size"
    return struct.from_buffer_copy(bytes(buf[:size]))


def test_dht_config_layout():
    L = C.lib()
    cfg = filled(C.DhtConfig, L.ap_dht_config_default)
    assert (cfg.k, cfg.alpha, cfg.depth_mod, cfg.num_replicas) == (20, 3, 5, 5)
    assert cfg.rpc_timeout_us == 3_000_000 and cfg.max_failures == 3
    assert cfg.max_records == 100_000 and cfg.max_bytes == 64 << 20
    assert cfg.max_ttl_ms == 86_400_000
    assert cfg.cache_remote is True and cfg.client_mode is False
    assert cfg.nannounce == 0 and cfg.republish_period_us == 600_000_000


def test_collab_config_layout():
    L = C.lib()
    C.collab_protos(L)
    cfg = filled(C.CollabConfig, L.ap_collab_config_default)
    assert cfg.role == C.AP_AVG_NORMAL
    assert cfg.solver.kind == C.AP_NN_ADAM
    assert abs(cfg.solver.beta1 - 0.9) < 1e-6 and abs(cfg.solver.beta2 - 0.999) < 1e-6
    assert abs(cfg.lr.base - 1e-3) < 1e-9 and abs(cfg.lr.min - 1e-3) < 1e-9
    assert cfg.average_state_every == 5
    assert cfg.load_state_on_start is True
    assert cfg.delayed_updates is False and cfg.dht_matchmaking is False
    assert cfg.max_local_samples == 0 and cfg.model_desc is None
    assert cfg.run_owner is None and cfg.token is None
    assert cfg.btard_attack_step == 0 and cfg.btard_validators == 0
    assert cfg.btard_grad is None and cfg.btard_grad_arg is None
