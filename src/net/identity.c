/* Ed25519 identity and its key file (format: see apiary/identity.h). */
#include "apiary/identity.h"
#include "apiary/error.h"
#include "apiary/log.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <sodium.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define MOD "identity"

/* protobuf PrivateKey{Type = Ed25519 (1), Data = 64 bytes} */
static const uint8_t file_prefix[4] = {0x08, 0x01, 0x12, 0x40};

static void fill_from_sk(ap_identity_t *out, const uint8_t sk[AP_ED25519_SK_LEN])
{
    memcpy(out->sk, sk, AP_ED25519_SK_LEN);
    crypto_sign_ed25519_sk_to_pk(out->pk, out->sk);
    ap_peer_id_from_ed25519(&out->id, out->pk);
}

int ap_identity_generate(ap_identity_t *out)
{
    if (sodium_init() < 0) return AP_ESYS;
    uint8_t seed[AP_IDENTITY_SEED_LEN];
    randombytes_buf(seed, sizeof seed);
    int rc = ap_identity_from_seed(out, seed);
    sodium_memzero(seed, sizeof seed);
    return rc;
}

int ap_identity_from_seed(ap_identity_t *out, const uint8_t seed[AP_IDENTITY_SEED_LEN])
{
    if (sodium_init() < 0) return AP_ESYS;
    uint8_t pk[AP_ED25519_PK_LEN], sk[AP_ED25519_SK_LEN];
    crypto_sign_seed_keypair(pk, sk, seed);
    fill_from_sk(out, sk);
    sodium_memzero(sk, sizeof sk);
    return 0;
}

void ap_identity_encode(const ap_identity_t *id, uint8_t out[AP_IDENTITY_FILE_LEN])
{
    memcpy(out, file_prefix, sizeof file_prefix);
    memcpy(out + sizeof file_prefix, id->sk, AP_ED25519_SK_LEN);
}

int ap_identity_decode(ap_identity_t *out, const uint8_t *data, size_t len)
{
    if (!data || len != AP_IDENTITY_FILE_LEN) return AP_ECORRUPT;
    if (memcmp(data, file_prefix, sizeof file_prefix) != 0) return AP_ECORRUPT;
    if (sodium_init() < 0) return AP_ESYS;
    /* Re-derive the key pair from the seed: the stored public half must be
     * the seed's, or the file was damaged (or crafted). */
    const uint8_t *sk = data + sizeof file_prefix;
    ap_identity_t tmp;
    int rc = ap_identity_from_seed(&tmp, sk);
    if (rc != 0) return rc;
    if (sodium_memcmp(tmp.pk, sk + AP_IDENTITY_SEED_LEN, AP_ED25519_PK_LEN) != 0) {
        ap_identity_wipe(&tmp);
        return AP_ECORRUPT;
    }
    *out = tmp;
    ap_identity_wipe(&tmp);
    return 0;
}

void ap_identity_wipe(ap_identity_t *id)
{
    sodium_memzero(id->sk, sizeof id->sk);
}

/* The cause of the last failed load or save on this thread, for the caller's
 * message; also logged (a missing file, the normal start of
 * load_or_create, is not). */
static _Thread_local char last_error[512];

const char *ap_identity_last_error(void)
{
    return last_error;
}

static int id_fail(int rc, const char *fmt, ...) AP_PRINTF(2, 3);
static int id_fail(int rc, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    if (rc != AP_ENOTFOUND) ap_error(MOD, "%s", last_error);
    return rc;
}

int ap_identity_load(ap_identity_t *out, const char *path)
{
    last_error[0] = 0;
    if (!path || !*path) return id_fail(AP_EINVAL, "no identity file path given");
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) {
        int e = errno;
        if (e == ENOENT) return id_fail(AP_ENOTFOUND, "identity file %s does not exist", path);
        if (e == ELOOP) {
            return id_fail(AP_EPERM, "identity file %s is a symbolic link; give the real path",
                           path);
        }
        return id_fail(e == EACCES ? AP_EPERM : AP_EIO, "cannot open identity file %s: %s", path,
                       strerror(e));
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return id_fail(AP_EIO, "cannot stat identity file %s: %s", path, strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return id_fail(AP_EPERM, "identity file %s is not a regular file", path);
    }
    if (st.st_mode & (S_IRWXG | S_IRWXO)) {
        close(fd);
        return id_fail(AP_EPERM,
                       "identity file %s is accessible by group or others (mode %04o); the "
                       "private key must stay private: run 'chmod 600 %s'",
                       path, (unsigned)(st.st_mode & 07777), path);
    }
    /* Read one byte more than a valid file so an over-long file is caught. */
    uint8_t buf[AP_IDENTITY_FILE_LEN + 1];
    size_t n = 0;
    while (n < sizeof buf) {
        ssize_t r = read(fd, buf + n, sizeof buf - n);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
            int e = errno;
            close(fd);
            sodium_memzero(buf, sizeof buf);
            return id_fail(AP_EIO, "cannot read identity file %s: %s", path, strerror(e));
        }
        if (r == 0) break;
        n += (size_t)r;
    }
    close(fd);
    int rc = ap_identity_decode(out, buf, n);
    sodium_memzero(buf, sizeof buf);
    if (rc == AP_ECORRUPT)
        return id_fail(rc,
                       "identity file %s is corrupt (%zu bytes; expected a %d-byte libp2p "
                       "Ed25519 private key); move it away to create a new identity",
                       path, n, AP_IDENTITY_FILE_LEN);
    if (rc != 0) return id_fail(rc, "identity file %s: %s", path, ap_strerror(rc));
    return rc;
}

static int write_all(int fd, const uint8_t *p, size_t n)
{
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

int ap_identity_save(const ap_identity_t *id, const char *path)
{
    last_error[0] = 0;
    if (!path || !*path) return id_fail(AP_EINVAL, "no identity file path given");
    char tmp[PATH_MAX];
    if (snprintf(tmp, sizeof tmp, "%s.tmp.XXXXXX", path) >= (int)sizeof tmp) return AP_EINVAL;
    /* mkstemp creates the file with mode 0600 and O_EXCL. */
    int fd = mkostemp(tmp, O_CLOEXEC);
    if (fd < 0) {
        int e = errno;
        return id_fail(e == EACCES ? AP_EPERM : AP_EIO,
                       "cannot create identity file %s (temporary file %s): %s", path, tmp,
                       strerror(e));
    }
    uint8_t buf[AP_IDENTITY_FILE_LEN];
    ap_identity_encode(id, buf);
    int ok = fchmod(fd, 0600) == 0 && write_all(fd, buf, sizeof buf) == 0 && fsync(fd) == 0;
    int e = errno;
    sodium_memzero(buf, sizeof buf);
    if (close(fd) != 0 && ok) {
        ok = 0;
        e = errno;
    }
    if (!ok) {
        unlink(tmp);
        return id_fail(AP_EIO, "cannot write identity file %s: %s", path, strerror(e));
    }
    /* link() never replaces an existing file, unlike rename(): a key that
     * someone already relies on is never silently overwritten. */
    int rc = 0;
    if (link(tmp, path) != 0) {
        e = errno;
        if (e == EEXIST) {
            rc = AP_EEXIST;
        } else {
            rc = id_fail(e == EACCES ? AP_EPERM : AP_EIO, "cannot create identity file %s: %s",
                         path, strerror(e));
        }
    }
    unlink(tmp);
    if (rc == 0) {
        /* Make the new directory entry durable too. */
        char dir[PATH_MAX];
        snprintf(dir, sizeof dir, "%s", path);
        char *slash = strrchr(dir, '/');
        if (slash == dir)
            dir[1] = 0;
        else if (slash)
            *slash = 0;
        else
            snprintf(dir, sizeof dir, ".");
        int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (dfd >= 0) {
            (void)fsync(dfd);
            close(dfd);
        }
    }
    return rc;
}

int ap_identity_load_or_create(ap_identity_t *out, const char *path, bool *created)
{
    if (created) *created = false;
    int rc = ap_identity_load(out, path);
    if (rc != AP_ENOTFOUND) return rc;
    ap_identity_t fresh;
    rc = ap_identity_generate(&fresh);
    if (rc != 0) return rc;
    rc = ap_identity_save(&fresh, path);
    if (rc == 0) {
        *out = fresh;
        ap_identity_wipe(&fresh);
        if (created) *created = true;
        char s[AP_PEER_ID_STR_MAX];
        ap_info(MOD, "created identity %s in %s", ap_peer_id_str(&out->id, s), path);
        return 0;
    }
    ap_identity_wipe(&fresh);
    if (rc == AP_EEXIST) return ap_identity_load(out, path); /* lost a creation race */
    return rc;
}
