/* Clean-up of test namespaces at exit and on signals: see nsguard.h. */
#include "nsguard.h"

#include <signal.h>
#include <stdbool.h>
#include <stdlib.h>
#include <unistd.h>

#define MAX_LIVE 16

typedef struct entry {
    ap_nsguard_fn fn;
    void *arg;
    pid_t owner;
} entry_t;

static volatile entry_t g_live[MAX_LIVE];
static bool g_atexit;
static const int g_sigs[3] = {SIGINT, SIGTERM, SIGHUP};
static struct sigaction g_old[3];
static bool g_hooked[3];

static void run_all(void)
{
    const pid_t me = getpid();
    for (int k = 0; k < MAX_LIVE; k++)
        if (g_live[k].fn && g_live[k].owner == me) g_live[k].fn(g_live[k].arg);
}

static void on_signal(int sig)
{
    run_all();
    signal(sig, SIG_DFL);
    raise(sig);
}

bool ap_nsguard_add(ap_nsguard_fn fn, void *arg)
{
    int k = 0;
    while (k < MAX_LIVE && g_live[k].fn) k++;
    if (k == MAX_LIVE) return false;
    g_live[k].arg = arg;
    g_live[k].owner = getpid();
    g_live[k].fn = fn;
    if (!g_atexit) g_atexit = atexit(run_all) == 0;
    for (int s = 0; s < 3; s++) {
        if (g_hooked[s]) continue;
        struct sigaction cur;
        if (sigaction(g_sigs[s], NULL, &cur) || cur.sa_handler != SIG_DFL) continue;
        struct sigaction sa = {.sa_handler = on_signal};
        sigemptyset(&sa.sa_mask);
        if (sigaction(g_sigs[s], &sa, &g_old[s]) == 0) g_hooked[s] = true;
    }
    return true;
}

void ap_nsguard_remove(void *arg)
{
    bool any = false;
    for (int k = 0; k < MAX_LIVE; k++) {
        if (g_live[k].fn && g_live[k].arg == arg) g_live[k].fn = NULL;
        if (g_live[k].fn) any = true;
    }
    if (any) return;
    for (int s = 0; s < 3; s++)
        if (g_hooked[s]) {
            sigaction(g_sigs[s], &g_old[s], NULL);
            g_hooked[s] = false;
        }
}
