/* Helpers for tests that run the `apiary` CLI as separate processes. */
#include "procs.h"

#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

const char *ap_test_cli(void)
{
    const char *c = getenv("APIARY_CLI");
    return c ? c : "./apiary";
}

pid_t ap_test_spawn_log(char *const argv[], const char *log)
{
    pid_t pid = fork();
    if (pid == 0) {
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
        }
        execv(ap_test_cli(), argv);
        _exit(127);
    }
    return pid;
}

bool ap_test_grep_file(const char *path, const char *needle, char *out, size_t n)
{
    FILE *f = fopen(path, "r");
    if (!f) return false;
    char line[1024];
    bool found = false;
    while (fgets(line, sizeof line, f))
        if (strstr(line, needle)) {
            if (out) snprintf(out, n, "%s", line);
            found = true;
        }
    fclose(f);
    return found;
}

void ap_test_sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

int ap_test_wait_exit(pid_t pid, int seconds)
{
    for (int i = 0; i < seconds * 10; i++) {
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid) return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
        ap_test_sleep_ms(100);
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    return -1;
}
