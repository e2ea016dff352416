#include "proc.h"

#include <stdio.h>
#include <string.h>
#include <unistd.h>

pid_t ap_cli_spawn_logged(const char *exe, char *const argv[], const char *log)
{
    fflush(stdout); /* a child must not inherit unflushed output */
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        if (!freopen(log, "w", stdout)) _exit(127);
        dup2(fileno(stdout), STDERR_FILENO);
        execv(exe, argv);
        _exit(127);
    }
    return pid;
}

bool ap_cli_last_line(const char *path, const char *prefix, char *out, size_t n)
{
    FILE *f = fopen(path, "r");
    if (!f) return false;
    char line[1024];
    bool found = false;
    while (fgets(line, sizeof line, f))
        if (strncmp(line, prefix, strlen(prefix)) == 0) {
            snprintf(out, n, "%s", line);
            found = true;
        }
    fclose(f);
    if (found) out[strcspn(out, "\n")] = 0;
    return found;
}
