#include "fake_conn.h"

#include <string.h>

static int fake_write(ap_conn_t *c, const uint8_t *p, size_t n)
{
    ap_test_fake_conn_t *f = (ap_test_fake_conn_t *)c;
    if (f->len + n <= sizeof f->out) {
        memcpy(f->out + f->len, p, n);
        f->len += n;
    }
    return 0;
}

static void fake_close(ap_conn_t *c)
{
    ((ap_test_fake_conn_t *)c)->closed = true;
}

static const ap_conn_vt_t fake_vt = {.write = fake_write, .close = fake_close};

void ap_test_fake_conn_init(ap_test_fake_conn_t *f)
{
    memset(f, 0, sizeof *f);
    f->conn.vt = &fake_vt;
}
