/* Child processes for the CLI's multi-process commands (demo, bench train). */
#ifndef AP_CLI_PROC_H
#define AP_CLI_PROC_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

/* Starts exe with argv, stdout and stderr into the file log (truncated).
 * Returns the child's pid, or -1 if fork failed. */
pid_t ap_cli_spawn_logged(const char *exe, char *const argv[], const char *log);
/* Copies the last line of the file path that starts with prefix into out
 * (n bytes, without its newline). False if there is none. */
bool ap_cli_last_line(const char *path, const char *prefix, char *out, size_t n);

#endif
