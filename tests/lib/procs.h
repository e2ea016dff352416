/* Helpers for tests that run the `apiary` CLI as separate processes; the
 * process helpers themselves are testing/proc.h. */
#ifndef AP_TEST_PROCS_H
#define AP_TEST_PROCS_H

#include "proc.h"

#include <stdbool.h>
#include <stddef.h>

/* The built CLI: $APIARY_CLI (ctest sets it), else ./apiary. */
const char *ap_test_cli(void);
/* ap_proc_spawn_log of the CLI. */
pid_t ap_test_spawn_log(char *const argv[], const char *log);

/* Forks; the child enters the network namespace called ns_name (nscmd.h),
 * sends stdout and stderr to log and runs the CLI with argv (argv[0] is
 * ignored). The child exits 126 when it cannot enter or open the log. */
pid_t ap_test_spawn_in_ns(const char *ns_name, char *const argv[], const char *log);
/* Polls log for a line holding needle, every 100 ms for up to seconds;
 * true (the line in out) when found. */
bool ap_test_wait_line(const char *log, const char *needle, char *out, size_t n, int seconds);

#endif
