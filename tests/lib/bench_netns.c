/* bench/netns.c built into the test library, so tests/net can make shaped
 * links in network namespaces with the same code as `apiary bench`. */
#include "../../bench/netns.c"
