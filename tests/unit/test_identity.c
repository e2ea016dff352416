#include "aptest.h"

#include "apiary/identity.h"
#include "apiary/log.h"

#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char dir[256];
static char last_log[1024];
static int nlogs;

static void sink(void *arg, ap_log_level_t lvl, const char *mod, const char *msg)
{
    (void)arg;
    (void)lvl;
    (void)mod;
    snprintf(last_log, sizeof last_log, "%s", msg);
    nlogs++;
}

static int setup(void **state)
{
    (void)state;
    snprintf(dir, sizeof dir, "/tmp/apiary-identity-XXXXXX");
    if (!mkdtemp(dir)) return -1;
    ap_log_set_sink(sink, NULL);
    nlogs = 0;
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    ap_log_set_sink(NULL, NULL);
    return system(cmd) == 0 ? 0 : -1;
}

static void path_of(char *out, size_t cap, const char *name)
{
    snprintf(out, cap, "%s/%s", dir, name);
}

static void write_file(const char *path, const void *p, size_t n, mode_t mode)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(p, 1, n, f), n);
    fclose(f);
    assert_int_equal(chmod(path, mode), 0);
}

/* A known seed gives a known PeerID (the libp2p text form of its public key),
 * and the encoding is libp2p's protobuf PrivateKey. */
static void test_seed_and_encoding(void **state)
{
    (void)state;
    uint8_t seed[32];
    for (int i = 0; i < 32; i++) seed[i] = (uint8_t)i;
    ap_identity_t id;
    assert_ok(ap_identity_from_seed(&id, seed));
    uint8_t pk[32], sk[64];
    crypto_sign_seed_keypair(pk, sk, seed);
    assert_memory_equal(id.pk, pk, 32);
    assert_memory_equal(id.sk, sk, 64);
    char s[AP_PEER_ID_STR_MAX];
    ap_peer_id_str(&id.id, s);
    assert_true(strncmp(s, "12D3KooW", 8) == 0);
    uint8_t enc[AP_IDENTITY_FILE_LEN];
    ap_identity_encode(&id, enc);
    const uint8_t hdr[4] = {0x08, 0x01, 0x12, 0x40};
    assert_memory_equal(enc, hdr, 4);
    assert_memory_equal(enc + 4, seed, 32);
    assert_memory_equal(enc + 36, pk, 32);
    ap_identity_t back;
    assert_ok(ap_identity_decode(&back, enc, sizeof enc));
    assert_memory_equal(back.sk, id.sk, 64);
    assert_true(ap_peer_id_eq(&back.id, &id.id));
}

static void test_decode_strict(void **state)
{
    (void)state;
    ap_identity_t id, out;
    assert_ok(ap_identity_generate(&id));
    uint8_t enc[AP_IDENTITY_FILE_LEN + 1];
    ap_identity_encode(&id, enc);
    assert_int_equal(ap_identity_decode(&out, enc, AP_IDENTITY_FILE_LEN - 1), AP_ECORRUPT);
    enc[AP_IDENTITY_FILE_LEN] = 0;
    assert_int_equal(ap_identity_decode(&out, enc, AP_IDENTITY_FILE_LEN + 1), AP_ECORRUPT);
    assert_int_equal(ap_identity_decode(&out, NULL, 0), AP_ECORRUPT);
    for (int i = 0; i < 4; i++) {
        uint8_t bad[AP_IDENTITY_FILE_LEN];
        memcpy(bad, enc, sizeof bad);
        bad[i] ^= 0x01; /* key type, field tags, length */
        assert_int_equal(ap_identity_decode(&out, bad, sizeof bad), AP_ECORRUPT);
    }
    /* public half that does not belong to the seed */
    uint8_t bad[AP_IDENTITY_FILE_LEN];
    memcpy(bad, enc, sizeof bad);
    bad[AP_IDENTITY_FILE_LEN - 1] ^= 0x80;
    assert_int_equal(ap_identity_decode(&out, bad, sizeof bad), AP_ECORRUPT);
    /* a flipped seed bit changes the derived public key too */
    memcpy(bad, enc, sizeof bad);
    bad[10] ^= 0x01;
    assert_int_equal(ap_identity_decode(&out, bad, sizeof bad), AP_ECORRUPT);
}

static void test_create_then_load(void **state)
{
    (void)state;
    char p[300];
    path_of(p, sizeof p, "node.key");
    ap_identity_t a, b;
    bool created = false;
    assert_ok(ap_identity_load_or_create(&a, p, &created));
    assert_true(created);
    struct stat st;
    assert_int_equal(stat(p, &st), 0);
    assert_int_equal(st.st_mode & 07777, 0600);
    assert_int_equal(st.st_size, AP_IDENTITY_FILE_LEN);
    assert_ok(ap_identity_load_or_create(&b, p, &created));
    assert_false(created);
    assert_true(ap_peer_id_eq(&a.id, &b.id));
    assert_memory_equal(a.sk, b.sk, 64);
    /* save never clobbers */
    ap_identity_t c;
    assert_ok(ap_identity_generate(&c));
    assert_int_equal(ap_identity_save(&c, p), AP_EEXIST);
    assert_ok(ap_identity_load(&b, p));
    assert_true(ap_peer_id_eq(&a.id, &b.id));
    /* no temporary files left behind */
    char cmd[400];
    snprintf(cmd, sizeof cmd, "test $(ls -1 %s | wc -l) -eq 1", dir);
    assert_int_equal(system(cmd), 0);
}

static void test_refuses_readable_file(void **state)
{
    (void)state;
    char p[300];
    path_of(p, sizeof p, "open.key");
    ap_identity_t id, out;
    assert_ok(ap_identity_generate(&id));
    uint8_t enc[AP_IDENTITY_FILE_LEN];
    ap_identity_encode(&id, enc);
    const mode_t bad_modes[] = {0644, 0640, 0604, 0660, 0602};
    for (size_t i = 0; i < sizeof bad_modes / sizeof bad_modes[0]; i++) {
        write_file(p, enc, sizeof enc, bad_modes[i]);
        nlogs = 0;
        assert_int_equal(ap_identity_load(&out, p), AP_EPERM);
        assert_int_equal(nlogs, 1);
        assert_non_null(strstr(last_log, "chmod 600"));
        assert_non_null(strstr(last_log, p));
        /* load_or_create must not replace it either */
        assert_int_equal(ap_identity_load_or_create(&out, p, NULL), AP_EPERM);
        unlink(p);
    }
    write_file(p, enc, sizeof enc, 0400);
    assert_ok(ap_identity_load(&out, p));
    assert_true(ap_peer_id_eq(&out.id, &id.id));
    unlink(p);
}

static void test_corrupt_file(void **state)
{
    (void)state;
    char p[300];
    path_of(p, sizeof p, "bad.key");
    ap_identity_t out;
    const char junk[] = "this is not a key";
    write_file(p, junk, sizeof junk, 0600);
    nlogs = 0;
    assert_int_equal(ap_identity_load(&out, p), AP_ECORRUPT);
    assert_int_equal(nlogs, 1);
    assert_non_null(strstr(last_log, "corrupt"));
    assert_int_equal(ap_identity_load_or_create(&out, p, NULL), AP_ECORRUPT);
    /* empty and over-long files */
    write_file(p, "", 0, 0600);
    assert_int_equal(ap_identity_load(&out, p), AP_ECORRUPT);
    uint8_t big[200] = {0x08, 0x01, 0x12, 0x40};
    write_file(p, big, sizeof big, 0600);
    assert_int_equal(ap_identity_load(&out, p), AP_ECORRUPT);
    /* missing file, directory, symlink */
    path_of(p, sizeof p, "missing.key");
    assert_int_equal(ap_identity_load(&out, p), AP_ENOTFOUND);
    assert_int_equal(ap_identity_load(&out, dir), AP_EPERM);
    char target[300], link_path[300];
    path_of(target, sizeof target, "real.key");
    path_of(link_path, sizeof link_path, "link.key");
    ap_identity_t id;
    assert_ok(ap_identity_load_or_create(&id, target, NULL));
    assert_int_equal(symlink(target, link_path), 0);
    assert_int_equal(ap_identity_load(&out, link_path), AP_EPERM);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_seed_and_encoding, setup, teardown),
        cmocka_unit_test_setup_teardown(test_decode_strict, setup, teardown),
        cmocka_unit_test_setup_teardown(test_create_then_load, setup, teardown),
        cmocka_unit_test_setup_teardown(test_refuses_readable_file, setup, teardown),
        cmocka_unit_test_setup_teardown(test_corrupt_file, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
