/* Helpers for tests that run the `apiary` CLI as separate processes. */
#include "procs.h"

#include "nscmd.h"

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

const char *ap_test_cli(void)
{
    const char *c = getenv("APIARY_CLI");
    return c ? c : "./apiary";
}

pid_t ap_test_spawn_log(char *const argv[], const char *log)
{
    return ap_proc_spawn_log(ap_test_cli(), argv, log);
}

pid_t ap_test_spawn_in_ns(const char *ns_name, char *const argv[], const char *log)
{
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        if (ap_nscmd_enter(ns_name) != 0) _exit(126);
        FILE *f = freopen(log, "w", stdout);
        if (!f || dup2(fileno(stdout), 2) < 0) _exit(126);
        execv(ap_test_cli(), argv);
        _exit(127);
    }
    return pid;
}

bool ap_test_wait_line(const char *log, const char *needle, char *out, size_t n, int seconds)
{
    if (n) out[0] = 0;
    for (int i = 0; i < seconds * 10; i++) {
        if (ap_proc_grep_file(log, needle, out, n)) return true;
        ap_proc_sleep_ms(100);
    }
    return false;
}
