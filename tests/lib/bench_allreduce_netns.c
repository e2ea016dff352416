/* bench/allreduce_netns.c built into the test library: the all-reduce across
 * network namespaces, shared with `apiary bench allreduce-shaped`. */
#include "../../bench/allreduce_netns.c"
