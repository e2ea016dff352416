/* Helpers for tests that run the `apiary` CLI as separate processes. */
#include "procs.h"

#include <stdlib.h>

const char *ap_test_cli(void)
{
    const char *c = getenv("APIARY_CLI");
    return c ? c : "./apiary";
}

pid_t ap_test_spawn_log(char *const argv[], const char *log)
{
    return ap_proc_spawn_log(ap_test_cli(), argv, log);
}
