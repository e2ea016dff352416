/* The run monitor's model (tools/apiary/monitor_state.c) fed untrusted
 * progress records: each input is a series of records, [1 byte: peer][1
 * byte: len][len bytes: a packed Progress], decoded as the monitor does and
 * folded into the model; or, when the first byte is odd, raw bytes poured
 * into the monitor fields as they could arrive unchecked (NaN, infinities,
 * huge counters). The JSON and metrics rendered after must stay finite:
 * no "nan" or "inf" in the JSON, no line without a value in the metrics. */
#include "monitor.h"

#include "apiary/log.h"

#include <stdio.h>
#include <string.h>

#include <stdlib.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check(const mon_state_t *m)
{
    size_t len = 0;
    char *j = mon_render_json(m, &len);
    if (!j) return;
    if (strlen(j) != len || strstr(j, "nan") || strstr(j, "inf")) abort();
    free(j);
    char *t = mon_render_metrics(m, NULL, &len);
    if (!t) return;
    if (strlen(t) != len || (len && t[len - 1] != '\n') || strstr(t, " \n")) abort();
    free(t);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static mon_state_t m;
    static bool init;
    if (!init) {
        ap_log_set_level(AP_LOG_OFF);
        init = true;
    }
    if (mon_state_init(&m, "fuzz")) return 0;
    m.now_ms = 1700000000000;
    if (size < 1) goto out;
    bool raw = data[0] & 1;
    size_t i = 1;
    while (i + 2 <= size) {
        char id[AP_PEER_ID_STR_MAX];
        snprintf(id, sizeof id, "12D3KooWFuzzPeer%03u", data[i]);
        size_t len = data[i + 1];
        i += 2;
        if (len > size - i) len = size - i;
        ap_progress_t p;
        memset(&p, 0, sizeof p);
        if (raw) {
            /* the monitor fields straight from the bytes */
            uint8_t b[64] = {0};
            memcpy(b, data + i, len < sizeof b ? len : sizeof b);
            memcpy(&p.loss, b, 4);
            memcpy(&p.bytes_sent, b + 4, 8);
            memcpy(&p.bytes_received, b + 12, 8);
            memcpy(&p.rounds, b + 20, 8);
            memcpy(&p.rounds_failed, b + 28, 8);
            memcpy(&p.last_group, b + 36, 4);
            memcpy(&p.last_round_ms, b + 40, 4);
            memcpy(&p.last_fraction, b + 44, 4);
            memcpy(&p.epoch, b + 48, 8);
            p.time_ms = m.now_ms - (int64_t)b[56] * 1000;
            p.role = (ap_avg_role_t)(b[57] % 3);
            mon_state_put(&m, id, &p);
        } else if (ap_progress_decode(data + i, len, m.now_ms, 30000, &p) == 0) {
            mon_state_put(&m, id, &p);
        }
        i += len;
        m.now_ms += 500;
        mon_state_update(&m);
    }
    check(&m);
out:
    mon_state_free(&m);
    return 0;
}
