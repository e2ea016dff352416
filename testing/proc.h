/* Child processes for tests, benchmarks and the CLI's multi-process commands
 * (demo, bench train): start one with its output in a log file, read its
 * log, wait for it with a time limit. */
#ifndef AP_TESTING_PROC_H
#define AP_TESTING_PROC_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

/* Forks and execs exe with argv (argv[0] included), stdout and stderr into
 * the file log (created 0600, truncated). Returns the child's pid, or -1 if
 * fork failed; a child that cannot open the log or exec exits 127. */
pid_t ap_proc_spawn_log(const char *exe, char *const argv[], const char *log);
/* Copies the last line of the file path that starts with prefix into out
 * (n bytes, without its newline). False if there is none. */
bool ap_proc_last_line(const char *path, const char *prefix, char *out, size_t n);
/* Whether a line of the file contains needle; the last such line is copied
 * into out (n bytes, with its newline; out may be NULL). */
bool ap_proc_grep_file(const char *path, const char *needle, char *out, size_t n);
/* Prints the file's lines that contain needle (all lines if needle is
 * NULL), the last max of them, each prefixed with tag, to stdout: a failing
 * test shows what its processes logged. */
void ap_proc_print_tail(const char *path, const char *needle, int max, const char *tag);
void ap_proc_sleep_ms(int ms);
/* Waits up to seconds for pid to exit: its exit status, 128 if a signal
 * ended it, or -1 after killing it (SIGKILL) at the time limit. */
int ap_proc_wait_exit(pid_t pid, int seconds);

#endif
