/* Helpers for tests that run the `apiary` CLI as separate processes. */
#ifndef AP_TEST_PROCS_H
#define AP_TEST_PROCS_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

/* The built CLI: $APIARY_CLI (ctest sets it), else ./apiary. */
const char *ap_test_cli(void);
/* Forks and execs the CLI with argv (argv[0] included), stdout and stderr
 * to the file log (created 0600, truncated). Returns the child's pid. */
pid_t ap_test_spawn_log(char *const argv[], const char *log);
/* Whether a line of the file contains needle; the last such line is copied
 * into out (n bytes, may be NULL). */
bool ap_test_grep_file(const char *path, const char *needle, char *out, size_t n);
void ap_test_sleep_ms(int ms);
/* Waits up to seconds for pid to exit: its exit status, 128 if a signal
 * ended it, or -1 after killing it (SIGKILL) at the time limit. */
int ap_test_wait_exit(pid_t pid, int seconds);

#endif
