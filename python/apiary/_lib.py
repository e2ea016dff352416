"""ctypes bindings to libapiary.so: the C structures and functions the package uses.

The library is found, in this order, at $APIARY_LIB, next to the package in a
build tree (../../build/libapiary.so), in the library directory `make install`
wrote into _installed.py, or by the dynamic loader. Every function that blocks is one of the C library's *_sync
forms: they may be called from any Python thread, and ctypes releases the GIL
while they run.
"""
import ctypes
import ctypes.util
import os
import threading

_here = os.path.dirname(os.path.abspath(__file__))


def _find_library():
    env = os.environ.get("APIARY_LIB")
    if env:
        return env
    for cand in (os.path.join(_here, "..", "..", "build", "libapiary.so"),
                 os.path.join(_here, "..", "..", "libapiary.so")):
        if os.path.exists(cand):
            return os.path.abspath(cand)
    try:  # installed by make install, which writes _installed.py
        from ._installed import LIBDIR
    except ImportError:
        LIBDIR = None
    for name in ("libapiary.so", "libapiary.so.0"):
        if LIBDIR and os.path.exists(os.path.join(LIBDIR, name)):
            return os.path.join(LIBDIR, name)
    found = ctypes.util.find_library("apiary")
    return found or "libapiary.so"


_lib = None
_lock = threading.Lock()

c_bool, c_int, c_size_t, c_u8, c_u32, c_u64, c_i64 = (ctypes.c_bool, ctypes.c_int, ctypes.c_size_t,
                                                     ctypes.c_uint8, ctypes.c_uint32,
                                                     ctypes.c_uint64, ctypes.c_int64)
c_char_p, c_void_p, c_double, c_float = ctypes.c_char_p, ctypes.c_void_p, ctypes.c_double, ctypes.c_float
P = ctypes.POINTER

AP_PEER_ID_LEN = 38
AP_PEER_ID_STR_MAX = 64
AP_RT_ADDR_MAX = 256
AP_DHT_MAX_ANNOUNCE = 4
AP_NODE_MAX_ANNOUNCE = 4
AP_DHT_KEY_MAX = 1024
AP_DHT_SUBKEY_MAX = 1024
AP_DHT_VALUE_MAX = 64 << 10


class PeerIdC(ctypes.Structure):
    _fields_ = [("b", c_u8 * AP_PEER_ID_LEN)]


class IdentityC(ctypes.Structure):
    _fields_ = [("sk", c_u8 * 64), ("pk", c_u8 * 32), ("id", PeerIdC)]


class NodeRelayLimits(ctypes.Structure):
    _fields_ = [("max_reservations", c_u32), ("circuits_per_peer", c_u32),
                ("circuit_duration_us", c_u64), ("circuit_bytes", c_u64)]


class NodeAdmission(ctypes.Structure):
    _fields_ = [("handshakes", c_u32), ("handshakes_per_ip", c_u32),
                ("handshake_timeout_ms", c_u32), ("conns", c_u32), ("conns_per_ip", c_u32)]


class NodeOpts(ctypes.Structure):
    _fields_ = [("ed25519_sk", P(c_u8)), ("ed25519_seed", P(c_u8)), ("rng_seed", c_u64),
                ("listen", c_char_p), ("announce", P(c_char_p)), ("nannounce", c_int),
                ("dial_only", c_bool), ("relay_service", c_bool),
                ("relay_limits", NodeRelayLimits), ("admission", NodeAdmission),
                ("relays", P(c_char_p)), ("nrelays", c_int), ("relay_bulk", c_bool),
                ("no_hole_punch", c_bool)]


class DhtConfig(ctypes.Structure):
    _fields_ = [("k", c_int), ("alpha", c_int), ("depth_mod", c_int), ("num_replicas", c_int),
                ("rpc_timeout_us", c_u64), ("refresh_period_us", c_u64),
                ("backoff_base_us", c_u64), ("backoff_max_us", c_u64), ("max_failures", c_int),
                ("max_records", c_size_t), ("max_bytes", c_size_t),
                ("max_stores_per_peer_per_min", c_u32), ("max_bytes_per_peer", c_size_t),
                ("max_records_per_peer", c_size_t), ("max_ttl_ms", c_i64),
                ("cache_max_records", c_size_t), ("cache_max_bytes", c_size_t),
                ("cache_remote", c_bool), ("client_mode", c_bool),
                ("announce", c_char_p * AP_DHT_MAX_ANNOUNCE), ("nannounce", c_int),
                ("republish_period_us", c_u64)]


class DhtRecord(ctypes.Structure):
    _fields_ = [("key", P(c_u8)), ("key_len", c_size_t), ("subkey", P(c_u8)),
                ("subkey_len", c_size_t), ("value", P(c_u8)), ("value_len", c_size_t),
                ("expiration_ms", c_i64)]


class DhtResult(ctypes.Structure):
    _fields_ = [("key", P(c_u8)), ("key_len", c_size_t), ("found", c_bool), ("is_dict", c_bool),
                ("nrecords", c_size_t), ("records", P(DhtRecord)), ("hops", c_int)]


def _proto(lib, name, res, *args):
    f = getattr(lib, name)
    f.restype = res
    f.argtypes = list(args)


def lib():
    """The loaded library (loaded on first use)."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        path = _find_library()
        try:
            L = ctypes.CDLL(path)
        except OSError as e:
            raise ImportError("apiary: cannot load libapiary.so (%s); build it with `make build` "
                              "or set APIARY_LIB to its path" % e) from None
        _proto(L, "ap_strerror", c_char_p, c_int)
        _proto(L, "ap_err_name", c_char_p, c_int)
        _proto(L, "ap_host_new", c_void_p)
        _proto(L, "ap_host_start", c_int, c_void_p)
        _proto(L, "ap_host_free", c_int, c_void_p)
        _proto(L, "ap_node_new", c_int, c_void_p, P(NodeOpts), P(c_void_p))
        _proto(L, "ap_node_free", None, c_void_p)
        _proto(L, "ap_node_listen_addrs_sync", c_int, c_void_p, P(ctypes.c_char * AP_RT_ADDR_MAX),
               c_int, c_bool)
        _proto(L, "ap_rt_self", P(PeerIdC), c_void_p)
        _proto(L, "ap_peer_id_str", c_char_p, P(PeerIdC), ctypes.c_char_p)
        _proto(L, "ap_identity_load_or_create", c_int, P(IdentityC), c_char_p, P(c_bool))
        _proto(L, "ap_identity_last_error", c_char_p)
        _proto(L, "ap_identity_wipe", None, P(IdentityC))
        _proto(L, "ap_dht_config_default", None, P(DhtConfig))
        _proto(L, "ap_dht_new_sync", c_int, c_void_p, P(DhtConfig), P(c_void_p))
        _proto(L, "ap_dht_free_sync", c_int, c_void_p)
        _proto(L, "ap_dht_bootstrap_sync", c_int, c_void_p, P(c_char_p), c_size_t)
        _proto(L, "ap_dht_store_sync", c_int, c_void_p, P(DhtRecord), P(c_int))
        _proto(L, "ap_dht_get_sync", c_int, c_void_p, P(c_u8), c_size_t, c_bool, P(P(DhtResult)))
        _proto(L, "ap_dht_result_free", None, P(DhtResult))
        _lib = L
        return L


def err_text(rc):
    L = lib()
    return "%s (%s)" % (L.ap_strerror(rc).decode(), L.ap_err_name(rc).decode())


def err_name(rc):
    return lib().ap_err_name(rc).decode()


class ApiaryError(RuntimeError):
    """A call into libapiary failed; .code is the negative AP_E* code, .name its name."""

    def __init__(self, what, rc):
        self.code = rc
        self.name = err_name(rc)
        super().__init__("%s: %s" % (what, err_text(rc)))


def check(rc, what):
    if rc < 0:
        raise ApiaryError(what, rc)
    return rc


def u8buf(b):
    """A ctypes uint8 pointer over bytes b (kept alive by the returned array)."""
    arr = (c_u8 * max(len(b), 1)).from_buffer_copy(b if b else b"\0")
    return arr


# ---- collaborative optimizer (apiary/collab.h) ----------------------------------------
AP_NN_SHAPE_WORDS = 16
AP_NN_SGD, AP_NN_ADAM, AP_NN_ADAMW, AP_NN_LAMB = 1, 2, 3, 4
AP_AVG_NORMAL, AP_AVG_CLIENT, AP_AVG_AUX = 0, 1, 2


class NnSolverConfig(ctypes.Structure):
    _fields_ = [("kind", c_int), ("momentum", c_float), ("nesterov", c_bool), ("beta1", c_float),
                ("beta2", c_float), ("eps", c_float), ("weight_decay", c_float)]


class LrSchedule(ctypes.Structure):
    _fields_ = [("kind", c_int), ("base", c_float), ("min", c_float), ("warmup", c_u64),
                ("total", c_u64)]


class CollabConfig(ctypes.Structure):
    _fields_ = [("run_id", c_char_p), ("target_batch_size", c_u64), ("role", c_int),
                ("solver", NnSolverConfig), ("lr", LrSchedule), ("max_grad_norm", c_double),
                ("model_kind", c_u32), ("model_shape", c_u32 * AP_NN_SHAPE_WORDS),
                ("average_state_every", c_u32), ("up", c_double), ("down", c_double),
                ("averaging_timeout_us", c_u64), ("chunk_elems", c_u32), ("codec", c_u8),
                ("state_codec", c_u8),
                ("matchmaking_window_us", c_u64), ("progress_ttl_ms", c_i64),
                ("stale_ms", c_i64), ("max_skew_ms", c_i64), ("min_refresh_us", c_u64),
                ("max_refresh_us", c_u64), ("max_donors", c_int),
                ("download_timeout_us", c_u64), ("load_state_on_start", c_bool),
                ("delayed_updates", c_bool), ("max_local_samples", c_u64),
                ("dht_matchmaking", c_bool), ("model_desc", c_char_p),
                ("byzantine_tolerant", c_bool), ("btard_tau", c_double),
                ("btard_max_iter", c_u32), ("btard_attack_shift", c_float),
                ("btard_attack_step", c_int),
                ("run_owner", c_char_p), ("token", c_char_p),
                ("btard_validators", c_u32), ("btard_grad", c_void_p),
                ("btard_grad_arg", c_void_p)]


class CollabStats(ctypes.Structure):
    _fields_ = [("epoch", c_u64), ("local_samples", c_u64), ("global_samples", c_double),
                ("global_sps", c_double), ("eta_s", c_double), ("peers", c_u32),
                ("last_group_size", c_u32), ("last_averaged_fraction", c_double)] + \
               [(n, c_u64) for n in ("last_epoch_samples", "epochs_failed", "state_rounds",
                                     "state_loads", "state_parts_refused", "records_refused",
                                     "bytes_served")] + \
               [("last_loss", c_float)] + \
               [(n, c_u64) for n in ("rounds", "bytes_sent", "bytes_received")] + \
               [("last_round_ms", c_u32)] + \
               [(n, c_u64) for n in ("samples_during_rounds", "delayed_steps", "submits_held",
                                     "samples_dropped", "group_wait_us", "averaging_us",
                                     "download_us", "state_donor_failures", "peers_refused")] + \
               [("refused", c_bool)] + \
               [(n, c_u64) for n in ("unauthorized_records", "unauthorized_requests")] + \
               [("shut_out", c_bool)] + \
               [(n, c_u64) for n in ("peers_banned", "btard_steps_dropped", "lone_epochs",
                                     "btard_named", "btard_left_out")]


def collab_protos(L):
    if getattr(L, "_collab_ready", False):
        return
    _proto(L, "ap_avg_service_new_sync", c_int, c_void_p, P(c_void_p))
    _proto(L, "ap_avg_service_free_sync", c_int, c_void_p, c_void_p)
    _proto(L, "ap_collab_config_default", None, P(CollabConfig))
    _proto(L, "ap_collab_new_sync", c_int, c_void_p, c_void_p, c_void_p, P(CollabConfig),
           P(c_float), c_size_t, c_void_p, c_size_t, P(c_void_p))
    _proto(L, "ap_collab_free_sync", None, c_void_p, c_void_p)
    _proto(L, "ap_collab_start_sync", c_int, c_void_p)
    _proto(L, "ap_collab_release_sync", None, c_void_p)
    _proto(L, "ap_collab_submit_sync", c_int, c_void_p, P(c_float), c_u32, c_float)
    _proto(L, "ap_collab_get_stats_sync", c_int, c_void_p, P(CollabStats))
    _proto(L, "ap_collab_refusal", c_char_p, c_void_p)
    _proto(L, "ap_collab_new_custom_sync", c_int, c_void_p, c_void_p, c_void_p, P(CollabConfig),
           P(c_float), c_size_t, c_size_t, c_void_p, c_void_p, P(c_void_p))
    _proto(L, "ap_collab_buffers", None, c_void_p, P(c_void_p), P(c_void_p), P(c_void_p),
           P(c_size_t))
    _proto(L, "ap_collab_optim_step", c_u64, c_void_p)
    _proto(L, "ap_collab_resume_sync", c_int, c_void_p, c_u64, c_u64)
    L._collab_ready = True


# ---- averaging (apiary/avg.h, apiary/averager.h) -------------------------------------
class AvgMatch(ctypes.Structure):
    _fields_ = [("key", P(c_u8)), ("key_len", c_size_t), ("target_group_size", c_u32),
                ("min_group_size", c_u32), ("deadline_at_us", c_u64), ("poll_us", c_u64),
                ("answer_grace_us", c_u64), ("exclude", c_void_p), ("exclude_arg", c_void_p),
                ("gather", P(c_u8)), ("gather_len", c_size_t)]


AVG_GATHER_MAX = 512  # AP_AVG_GATHER_MAX


class AllreduceOpts(ctypes.Structure):
    _fields_ = [("chunk_elems", c_u32), ("codec", c_u8), ("min_share", c_double),
                ("deadline_factor", c_double), ("deadline_slack_us", c_u64),
                ("stall_min_us", c_u64), ("stall_factor", c_double),
                ("connect_grace_us", c_u64), ("deadline_at_us", c_u64),
                ("max_lead_chunks", c_u32), ("reduce", c_void_p), ("reduce_arg", c_void_p)]


class AveragerOpts(ctypes.Structure):
    _fields_ = [("role", c_int), ("up", c_double), ("down", c_double), ("round", AllreduceOpts)]


class AvgMember(ctypes.Structure):
    _fields_ = [("id", PeerIdC), ("role", c_int), ("up", c_double), ("down", c_double)]


def averager_protos(L):
    if getattr(L, "_avg_ready", False):
        return
    collab_protos(L)
    _proto(L, "ap_avg_matchmaker_new_sync", c_int, c_void_p, c_void_p, c_void_p, P(c_void_p))
    _proto(L, "ap_avg_matchmaker_free_sync", c_int, c_void_p, c_void_p)
    _proto(L, "ap_averager_new_sync", c_int, c_void_p, c_void_p, P(c_size_t), c_size_t, c_void_p,
           P(c_void_p))
    _proto(L, "ap_averager_free_sync", c_int, c_void_p, c_void_p)
    _proto(L, "ap_averager_tensor", P(c_float), c_void_p, c_size_t, P(c_size_t))
    _proto(L, "ap_averager_step_sync", c_int, c_void_p, c_void_p, c_void_p, P(AvgMatch), c_u64,
           c_double, c_void_p, P(c_size_t))
    _proto(L, "ap_averager_last_group", c_size_t, c_void_p, P(AvgMember), c_size_t)
    _proto(L, "ap_averager_last_gather", c_int, c_void_p, c_size_t, P(c_u8), c_size_t)
    _proto(L, "ap_averager_member", None, c_void_p, P(AvgMember))
    _proto(L, "ap_averager_bandwidth", None, c_void_p, P(c_double), P(c_double))
    L._avg_ready = True
