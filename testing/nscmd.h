/* Running ip, tc, nft and friends for the network-namespace test beds
 * (netns.h, natns.h): commands with captured output, namespaces made and
 * removed, stale ones swept. Test and benchmark use only. */
#ifndef APIARY_TESTING_NSCMD_H
#define APIARY_TESTING_NSCMD_H

#include <stdbool.h>
#include <stddef.h>

/* The folder where `ip netns` keeps its namespaces. */
#define AP_NSCMD_DIR "/var/run/netns"

/* Runs argv (argv[0] looked up in PATH) with stdin from in_path (NULL:
 * /dev/null), stdout and stderr captured. 0 if it exited 0; else AP_ESYS
 * with the command and its output in why (when why is not NULL). When res
 * is not NULL it receives the output (truncated to rn - 1 bytes). */
int ap_nscmd_run(char *const argv[], const char *in_path, char *why, size_t wn, char *res,
                 size_t rn);

/* ap_nscmd_run() with a NULL-terminated list of at most 23 arguments. */
int ap_nscmd_runv(char *why, size_t wn, const char *a0, ...);

/* `ip netns add name` (and its loopback up when lo_up). */
int ap_nscmd_add(const char *name, bool lo_up, char *why, size_t wn);

/* `ip netns del name`; when that fails, what it does by hand: lazy unmount
 * of path (the namespace's bind mount) and unlink. */
void ap_nscmd_del(const char *name, const char *path);

/* Moves the calling thread into the network namespace called name. */
int ap_nscmd_enter(const char *name);

/* Removes the namespaces named "<prefix>-<pid>-..." whose creating process
 * no longer runs (left behind by a test that was killed). */
void ap_nscmd_sweep(const char *prefix);

#endif
