/* apiary — decentralized deep learning over the Internet. */
#include "cli.h"
#include "apiary/common.h"
#include "apiary/error.h"
#include "apiary/log.h"

#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_CMDS 64
static const ap_cli_cmd_t *cmds[MAX_CMDS];
static int ncmds;

void ap_cli_register(const ap_cli_cmd_t *cmd)
{
    if (ncmds < MAX_CMDS) cmds[ncmds++] = cmd;
}

const ap_cli_cmd_t *ap_cli_find(const char *name)
{
    for (int i = 0; i < ncmds; i++)
        if (strcmp(cmds[i]->name, name) == 0) return cmds[i];
    return NULL;
}

bool ap_cli_set_log_level(const char *text)
{
    ap_log_level_t lvl;
    if (ap_log_parse_level(text, &lvl) != 0) {
        fprintf(stderr, "apiary: unknown log level '%s' (use debug, info, warn, error or off)\n",
                text);
        return false;
    }
    ap_log_set_level(lvl);
    return true;
}

int ap_cli_count(const char *text, uint64_t *out)
{
    if (!text || *text < '0' || *text > '9') return AP_EINVAL;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(text, &end, 10);
    if (errno) return AP_EINVAL;
    uint64_t mul = 1;
    if (*end == 'K' || *end == 'k')
        mul = 1ull << 10, end++;
    else if (*end == 'M' || *end == 'm')
        mul = 1ull << 20, end++;
    else if (*end == 'G' || *end == 'g')
        mul = 1ull << 30, end++;
    if (*end || v > UINT64_MAX / mul) return AP_EINVAL;
    *out = v * mul;
    return 0;
}

bool ap_cli_int(const char *flag, const char *text, long long min, long long max, long long *out)
{
    char *end;
    errno = 0;
    long long v = text && *text ? strtoll(text, &end, 10) : 0;
    if (!text || !*text || errno || *end || v < min || v > max) {
        fprintf(stderr, "apiary: %s needs an integer from %lld to %lld (got '%s')\n", flag, min,
                max, text ? text : "");
        return false;
    }
    *out = v;
    return true;
}

bool ap_cli_num(const char *flag, const char *text, double min, double max, double *out)
{
    char *end;
    errno = 0;
    double v = text && *text ? strtod(text, &end) : NAN;
    if (!text || !*text || errno || *end || !isfinite(v) || v < min || v > max) {
        fprintf(stderr, "apiary: %s needs a number from %g to %g (got '%s')\n", flag, min, max,
                text ? text : "");
        return false;
    }
    *out = v;
    return true;
}

static int cmp_cmd(const void *a, const void *b)
{
    return strcmp((*(const ap_cli_cmd_t *const *)a)->name, (*(const ap_cli_cmd_t *const *)b)->name);
}

static void usage(FILE *f)
{
    fprintf(f, "usage: apiary <command> [options]\n\n"
               "Decentralized deep learning over the Internet.\n\ncommands:\n");
    qsort(cmds, (size_t)ncmds, sizeof cmds[0], cmp_cmd);
    for (int i = 0; i < ncmds; i++) fprintf(f, "  %-10s %s\n", cmds[i]->name, cmds[i]->summary);
    fprintf(f, "\nRun 'apiary <command> --help' for a command's options.\n"
               "Options for every command: --log-level LEVEL (or APIARY_LOG=LEVEL).\n");
}

int main(int argc, char **argv)
{
    /* no command may die of a peer closing a socket (writes return EPIPE instead) */
    signal(SIGPIPE, SIG_IGN);
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char *c = argv[1];
    if (!strcmp(c, "--help") || !strcmp(c, "-h") || !strcmp(c, "help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(c, "--version") || !strcmp(c, "version")) {
        printf("apiary %s\n", ap_version());
        return 0;
    }
    const ap_cli_cmd_t *cmd = ap_cli_find(c);
    if (!cmd) {
        fprintf(stderr, "apiary: unknown command '%s'\n\n", c);
        usage(stderr);
        return 2;
    }
    return cmd->main(argc - 1, argv + 1);
}
