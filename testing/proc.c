#include "proc.h"

#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

pid_t ap_proc_spawn_log(const char *exe, char *const argv[], const char *log)
{
    fflush(stdout); /* a child must not inherit unflushed output */
    fflush(stderr);
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (fd < 0) _exit(127);
        dup2(fd, STDOUT_FILENO);
        dup2(fd, STDERR_FILENO);
        if (fd > STDERR_FILENO) close(fd);
        execv(exe, argv);
        _exit(127);
    }
    return pid;
}

/* The last line of path that starts with (prefix) or contains needle, into
 * out (n bytes). */
static bool last_match(const char *path, const char *needle, bool prefix, char *out, size_t n)
{
    FILE *f = fopen(path, "r");
    if (!f) return false;
    char line[1024];
    bool found = false;
    while (fgets(line, sizeof line, f))
        if (prefix ? strncmp(line, needle, strlen(needle)) == 0 : strstr(line, needle) != NULL) {
            if (out) snprintf(out, n, "%s", line);
            found = true;
        }
    fclose(f);
    return found;
}

bool ap_proc_last_line(const char *path, const char *prefix, char *out, size_t n)
{
    bool found = last_match(path, prefix, true, out, n);
    if (found) out[strcspn(out, "\n")] = 0;
    return found;
}

bool ap_proc_grep_file(const char *path, const char *needle, char *out, size_t n)
{
    return last_match(path, needle, false, out, n);
}

void ap_proc_print_tail(const char *path, const char *needle, int max, const char *tag)
{
    FILE *f = fopen(path, "r");
    if (!f || max <= 0) {
        if (f) fclose(f);
        return;
    }
    char line[512];
    long n = 0, skip;
    while (fgets(line, sizeof line, f))
        if (!needle || strstr(line, needle)) n++;
    skip = n > max ? n - max : 0;
    rewind(f);
    while (fgets(line, sizeof line, f)) {
        if (needle && !strstr(line, needle)) continue;
        if (skip > 0) {
            skip--;
            continue;
        }
        line[strcspn(line, "\n")] = 0;
        printf("%s%s\n", tag, line);
    }
    fclose(f);
    fflush(stdout);
}

void ap_proc_sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

int ap_proc_wait_exit(pid_t pid, int seconds)
{
    for (int i = 0; i < seconds * 10; i++) {
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid) return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
        ap_proc_sleep_ms(100);
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    return -1;
}
