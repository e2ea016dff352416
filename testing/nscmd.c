/* Commands for the network-namespace test beds: see nscmd.h. */
#include "nscmd.h"

#include "apiary/error.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

static void join_argv(char *const argv[], char *out, size_t n)
{
    size_t at = 0;
    out[0] = 0;
    for (int i = 0; argv[i] && at + 1 < n; i++) {
        int w = snprintf(out + at, n - at, "%s%s", i ? " " : "", argv[i]);
        if (w < 0) break;
        at += (size_t)w;
    }
}

int ap_nscmd_run(char *const argv[], const char *in_path, char *why, size_t wn, char *res,
                 size_t rn)
{
    int p[2];
    if (pipe2(p, O_CLOEXEC)) {
        if (why) snprintf(why, wn, "pipe: %s", strerror(errno));
        return AP_ESYS;
    }
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 0, in_path ? in_path : "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_adddup2(&fa, p[1], 1);
    posix_spawn_file_actions_adddup2(&fa, p[1], 2);
    pid_t pid;
    int rc = posix_spawnp(&pid, argv[0], &fa, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    close(p[1]);
    char out[2048];
    size_t got = 0;
    if (rc == 0) {
        for (;;) {
            char tmp[512];
            ssize_t r = read(p[0], tmp, sizeof tmp);
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) break;
            size_t take = (size_t)r < sizeof out - 1 - got ? (size_t)r : sizeof out - 1 - got;
            memcpy(out + got, tmp, take);
            got += take;
        }
    }
    close(p[0]);
    out[got] = 0;
    if (res && rn) snprintf(res, rn, "%s", out);
    while (got && (out[got - 1] == '\n' || out[got - 1] == ' ')) out[--got] = 0;
    char cmd[256];
    join_argv(argv, cmd, sizeof cmd);
    if (rc) {
        if (why) snprintf(why, wn, "cannot run `%s`: %s", cmd, strerror(rc));
        return AP_ESYS;
    }
    int st;
    while (waitpid(pid, &st, 0) < 0)
        if (errno != EINTR) {
            if (why) snprintf(why, wn, "`%s`: waitpid: %s", cmd, strerror(errno));
            return AP_ESYS;
        }
    if (WIFEXITED(st) && WEXITSTATUS(st) == 0) return 0;
    if (why) snprintf(why, wn, "`%s` failed (status %d): %s", cmd, st, out);
    return AP_ESYS;
}

int ap_nscmd_runv(char *why, size_t wn, const char *a0, ...)
{
    char *argv[24];
    int n = 0;
    argv[n++] = (char *)a0;
    va_list ap;
    va_start(ap, a0);
    const char *s;
    while (n < 23 && (s = va_arg(ap, const char *))) argv[n++] = (char *)s;
    va_end(ap);
    argv[n] = NULL;
    return ap_nscmd_run(argv, NULL, why, wn, NULL, 0);
}

int ap_nscmd_add(const char *name, bool lo_up, char *why, size_t wn)
{
    int rc = ap_nscmd_runv(why, wn, "ip", "netns", "add", name, (char *)NULL);
    if (rc == 0 && lo_up) {
        rc = ap_nscmd_runv(why, wn, "ip", "-n", name, "link", "set", "lo", "up", (char *)NULL);
        if (rc) ap_nscmd_runv(NULL, 0, "ip", "netns", "del", name, (char *)NULL);
    }
    return rc;
}

void ap_nscmd_del(const char *name, const char *path)
{
    if (ap_nscmd_runv(NULL, 0, "ip", "netns", "del", name, (char *)NULL)) {
        umount2(path, MNT_DETACH);
        unlink(path);
    }
}

void ap_nscmd_sweep(const char *prefix)
{
    DIR *d = opendir(AP_NSCMD_DIR);
    if (!d) return;
    char fmt[64];
    snprintf(fmt, sizeof fmt, "%s-%%d-%%n", prefix);
    struct dirent *de;
    while ((de = readdir(d))) {
        int pid = 0, len = 0;
        if (sscanf(de->d_name, fmt, &pid, &len) != 1 || len == 0 || pid <= 0) continue;
        if (pid == (int)getpid() || kill(pid, 0) == 0 || errno != ESRCH) continue;
        ap_nscmd_runv(NULL, 0, "ip", "netns", "del", de->d_name, (char *)NULL);
    }
    closedir(d);
}

int ap_nscmd_enter(const char *name)
{
    char path[sizeof AP_NSCMD_DIR + 256];
    if (!name || snprintf(path, sizeof path, "%s/%s", AP_NSCMD_DIR, name) >= (int)sizeof path)
        return AP_EINVAL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return AP_ESYS;
    int rc = setns(fd, CLONE_NEWNET);
    close(fd);
    return rc ? AP_ESYS : 0;
}
