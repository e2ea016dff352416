/* Helpers for tests that run the `apiary` CLI as separate processes; the
 * process helpers themselves are testing/proc.h. */
#ifndef AP_TEST_PROCS_H
#define AP_TEST_PROCS_H

#include "proc.h"

/* The built CLI: $APIARY_CLI (ctest sets it), else ./apiary. */
const char *ap_test_cli(void);
/* ap_proc_spawn_log of the CLI. */
pid_t ap_test_spawn_log(char *const argv[], const char *log);

#endif
