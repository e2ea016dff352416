#include "aptest.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *ap_test_data_path(const char *rel)
{
    static char buf[4096];
    const char *dir = getenv("APIARY_TEST_DATA");
#ifdef APIARY_TEST_DATA_DIR
    if (!dir || !*dir) dir = APIARY_TEST_DATA_DIR;
#endif
    snprintf(buf, sizeof buf, "%s/%s", dir && *dir ? dir : "tests/data", rel);
    return buf;
}

char *ap_test_read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *p = n >= 0 ? malloc((size_t)n + 1) : NULL;
    if (p && fread(p, 1, (size_t)n, f) != (size_t)n) {
        free(p);
        p = NULL;
    }
    fclose(f);
    if (p) {
        p[n] = 0;
        if (len) *len = (size_t)n;
    }
    return p;
}

uint64_t ap_test_seed(uint64_t dflt)
{
    const char *e = getenv("APIARY_TEST_SEED");
    return e ? strtoull(e, NULL, 0) : dflt;
}

int ap_test_sanitized(void)
{
#ifdef APIARY_SANITIZED
    return 1;
#else
    return getenv("APIARY_SANITIZED") != NULL;
#endif
}

void ap_test_rpc_echo(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    (void)rt;
    (void)arg;
    size_t n;
    const uint8_t *d = ap_rpc_req_data(req, &n);
    ap_rpc_respond(req, d, n);
}
