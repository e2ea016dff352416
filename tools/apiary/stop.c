/* SIGINT and SIGTERM for the long-running commands (cli.h): a flag the
 * command's loop reads, so it stops on its own path (summary, state saved,
 * everything freed) and exits 0. */
#include "cli.h"

#include <signal.h>
#include <string.h>

static volatile sig_atomic_t stop_sig;

static void on_stop(int sig)
{
    stop_sig = sig;
}

void ap_cli_catch_stop(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_stop;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
}

int ap_cli_stop_signal(void)
{
    return stop_sig;
}

const char *ap_cli_stop_name(void)
{
    return stop_sig == SIGINT ? "SIGINT" : stop_sig == SIGTERM ? "SIGTERM" : "no signal";
}
