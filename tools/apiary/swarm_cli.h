/* `apiary swarm demo` (swarm_demo.c), dispatched from `apiary swarm`. */
#ifndef AP_SWARM_CLI_H
#define AP_SWARM_CLI_H

/* argv[0] is "demo". */
int ap_swarm_demo_main(int argc, char **argv);

#endif
