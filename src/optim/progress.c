/* Progress records: encoding and validation of untrusted records. */
#include "apiary/log.h"
#include "apiary/optim.h"

#include "optim.pb-c.h"

#include <math.h>

int ap_progress_encode(const ap_progress_t *p, uint8_t *buf, size_t cap)
{
    Apiary__Optim__Progress m = APIARY__OPTIM__PROGRESS__INIT;
    m.epoch = p->epoch;
    m.samples = p->samples;
    m.samples_per_s = p->samples_per_s;
    m.time_ms = p->time_ms;
    m.epoch_start_ms = p->epoch_start_ms;
    m.role = (uint32_t)p->role;
    m.up = p->up;
    m.down = p->down;
    m.donor = p->donor;
    m.ready_ms = p->ready_ms;
    size_t len = apiary__optim__progress__get_packed_size(&m);
    if (len > cap) return AP_EMSGSIZE;
    apiary__optim__progress__pack(&m, buf);
    return (int)len;
}

int ap_progress_decode(const uint8_t *buf, size_t len, int64_t now_ms, int64_t max_skew_ms,
                       ap_progress_t *out)
{
    if (len > 1024) return AP_ECORRUPT;
    Apiary__Optim__Progress *m = apiary__optim__progress__unpack(NULL, len, buf);
    if (!m) return AP_ECORRUPT;
    ap_progress_t p = {0};
    p.epoch = m->epoch;
    p.samples = m->samples;
    p.samples_per_s = m->samples_per_s;
    p.time_ms = m->time_ms;
    p.epoch_start_ms = m->epoch_start_ms;
    p.role = (ap_avg_role_t)m->role;
    p.up = m->up;
    p.down = m->down;
    p.donor = m->donor;
    p.ready_ms = m->ready_ms;
    uint32_t role = m->role;
    apiary__optim__progress__free_unpacked(m, NULL);

    if (p.samples < 0 || !isfinite(p.samples_per_s) || p.samples_per_s < 0 ||
        p.samples_per_s > AP_OPTIM_MAX_SPS || role > AP_AVG_AUX || !isfinite(p.up) ||
        !isfinite(p.down) || p.up < 0 || p.down < 0)
        return AP_ERANGE;
    if (p.time_ms > now_ms + max_skew_ms || p.epoch_start_ms > p.time_ms) return AP_ERANGE;
    if (p.ready_ms != 0 && (p.ready_ms < p.epoch_start_ms || p.ready_ms > p.time_ms))
        return AP_ERANGE;
    /* An honest peer's samples are its speed times the time it has been in
     * this epoch; allow a factor of two and one second of slack for the
     * speed estimate's smoothing. */
    double elapsed_s = (double)(p.time_ms - p.epoch_start_ms) / 1000.0;
    if ((double)p.samples > 2.0 * p.samples_per_s * (elapsed_s + 1.0) + 1.0) return AP_ELIMIT;
    *out = p;
    return 0;
}
