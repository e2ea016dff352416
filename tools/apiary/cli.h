/* The `apiary` command-line tool: subcommand registry.
 *
 * Each subcommand lives in its own file and registers itself with
 * AP_CLI_COMMAND, so adding one never edits a shared table. */
#ifndef AP_CLI_H
#define AP_CLI_H

#include <stdbool.h>

typedef struct ap_cli_cmd {
    const char *name;
    int (*main)(int argc, char **argv); /* argv[0] is the subcommand name */
    const char *summary;
} ap_cli_cmd_t;

void ap_cli_register(const ap_cli_cmd_t *cmd);
const ap_cli_cmd_t *ap_cli_find(const char *name);

#define AP_CLI_COMMAND(ident, cname, fn, text)                                                     \
    static const ap_cli_cmd_t ident = {.name = cname, .main = fn, .summary = text};                \
    __attribute__((constructor)) static void ident##_register(void)                                \
    {                                                                                              \
        ap_cli_register(&ident);                                                                   \
    }

/* Common helpers. */
/* Sets the log level from --log-level text; prints an error and returns
 * false if it is not a level. */
bool ap_cli_set_log_level(const char *text);

#endif
