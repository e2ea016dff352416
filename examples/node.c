/* Two nodes of the real driver on one host, talking TCP + Noise over
 * 127.0.0.1: the server registers an echo RPC, the client dials the server's
 * address and calls it. runtime.h functions belong to the node's loop
 * thread; this program's main thread reaches it with ap_node_call_sync. */
#include <apiary/host.h>
#include <apiary/node.h>
#include <apiary/sync.h>

#include <stdio.h>
#include <string.h>

#define ECHO_PROTO "/example/echo/1"

static void echo(ap_rt_t *rt, void *arg, ap_rpc_req_t *req)
{
    size_t len;
    const uint8_t *data = ap_rpc_req_data(req, &len);
    ap_rpc_respond(req, data, len);
}

static void serve(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    ap_sync_complete(done, ap_rt_rpc_register(rt, ECHO_PROTO, 0, echo, NULL));
}

typedef struct call {
    const char *addr; /* the server's multiaddr with /p2p/<id> */
    char reply[64];
    ap_sync_t *done;
} call_t;

static void on_reply(ap_rt_t *rt, void *arg, int status, const uint8_t *resp, size_t len,
                     const char *errmsg)
{
    call_t *c = arg;
    if (status == 0) snprintf(c->reply, sizeof c->reply, "%.*s", (int)len, (const char *)resp);
    ap_sync_complete(c->done, status);
}

static void on_dial(ap_rt_t *rt, void *arg, int status, const ap_peer_id_t *peer)
{
    call_t *c = arg;
    if (status != 0) {
        ap_sync_complete(c->done, status);
        return;
    }
    static const char msg[] = "hello";
    if (!ap_rt_rpc_call(rt, peer, ECHO_PROTO, (const uint8_t *)msg, strlen(msg), NULL, on_reply, c))
        ap_sync_complete(c->done, AP_ENOMEM);
}

static void dial_and_call(ap_rt_t *rt, void *arg, ap_sync_t *done)
{
    call_t *c = arg;
    c->done = done;
    int rc = ap_rt_dial(rt, c->addr, 10000000, on_dial, c);
    if (rc) ap_sync_complete(done, rc);
}

int main(void)
{
    ap_host_t *host = ap_host_new();
    if (!host || ap_host_start(host) != 0) return 1; /* the loop runs on its own thread */

    ap_rt_t *server, *client;
    ap_node_opts_t so = {.listen = "/ip4/127.0.0.1/tcp/0"}; /* fresh key, any free port */
    ap_node_opts_t co = {.dial_only = true};                /* TCP + Noise, no listener */
    int rc = ap_node_new(host, &so, &server);
    if (rc == 0) rc = ap_node_new(host, &co, &client);
    if (rc == 0) rc = ap_node_call_sync(server, serve, NULL);

    char addr[1][AP_RT_ADDR_MAX] = {""}; /* the server's, with /p2p/<id> */
    if (rc == 0 && ap_node_listen_addrs_sync(server, addr, 1, true) < 1) rc = AP_ESTATE;
    call_t c = {.addr = addr[0]};
    if (rc == 0) rc = ap_node_call_sync(client, dial_and_call, &c);
    if (rc == 0)
        printf("%s answered: %s\n", addr[0], c.reply);
    else
        fprintf(stderr, "example failed: %s\n", ap_strerror(rc));

    ap_host_stop(host);
    int frc = ap_host_free(host); /* frees the nodes too; 0 when everything closed */
    return rc == 0 && frc == 0 && strcmp(c.reply, "hello") == 0 ? 0 : 1;
}
