/* `apiary identity`: create or show a node's key file and PeerID. */
#include "cli.h"

#include "apiary/error.h"
#include "apiary/identity.h"
#include "apiary/multiaddr.h"

#include <getopt.h>
#include <stdio.h>
#include <string.h>

static void usage(FILE *f)
{
    fprintf(f, "usage: apiary identity [--identity PATH] [--log-level LEVEL]\n\n"
               "Prints the PeerID of the Ed25519 key in PATH (default: ./apiary.key),\n"
               "creating the key file (mode 0600) if it does not exist.\n"
               "  --identity PATH   key file (68 bytes, libp2p protobuf PrivateKey)\n"
               "  --addr MULTIADDR  also print MULTIADDR/p2p/<PeerID>\n");
}

static int identity_main(int argc, char **argv)
{
    const char *path = "apiary.key", *addr = NULL;
    static const struct option opts[] = {{"identity", required_argument, NULL, 'i'},
                                         {"addr", required_argument, NULL, 'a'},
                                         {"log-level", required_argument, NULL, 'l'},
                                         {"help", no_argument, NULL, 'h'},
                                         {NULL, 0, NULL, 0}};
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "i:a:l:h", opts, NULL)) != -1) {
        switch (c) {
        case 'i':
            path = optarg;
            break;
        case 'a':
            addr = optarg;
            break;
        case 'l':
            if (!ap_cli_set_log_level(optarg)) return 2;
            break;
        case 'h':
            usage(stdout);
            return 0;
        default:
            usage(stderr);
            return 2;
        }
    }
    if (optind != argc) {
        usage(stderr);
        return 2;
    }
    ap_multiaddr_t ma;
    if (addr && (ap_multiaddr_parse(&ma, addr) != 0 || ma.has_peer)) {
        fprintf(stderr,
                "apiary identity: '%s' is not a multiaddr without /p2p/ (e.g. "
                "/ip4/1.2.3.4/tcp/31337)\n",
                addr);
        return 2;
    }
    ap_identity_t id;
    bool created = false;
    int rc = ap_identity_load_or_create(&id, path, &created);
    if (rc != 0) {
        fprintf(stderr, "apiary identity: cannot use %s: %s\n", path,
                *ap_identity_last_error() ? ap_identity_last_error() : ap_strerror(rc));
        return 1;
    }
    char s[AP_PEER_ID_STR_MAX];
    ap_peer_id_str(&id.id, s);
    ap_identity_wipe(&id);
    if (created) fprintf(stderr, "created a new identity in %s\n", path);
    if (addr) {
        ma.has_peer = true;
        ap_peer_id_parse(&ma.peer, s);
        char text[AP_MA_TEXT_MAX];
        ap_multiaddr_print(&ma, text, sizeof text);
        printf("%s\n", text);
    } else {
        printf("%s\n", s);
    }
    return 0;
}

AP_CLI_COMMAND(identity_cmd, "identity", identity_main, "create or show this node's key and PeerID")
