/* Apiary — the whole public API in one include. Each header below documents
 * its part; include only the ones a program uses if it prefers.
 *   common.h    version, export macros          error.h     error codes
 *   log.h       logging                         peer.h      peer identities
 *   identity.h  key pairs and key files         multiaddr.h network addresses
 *   runtime.h   the runtime interface           node.h      the libuv driver
 *   sim.h       the network simulator           dht.h       the Kademlia DHT
 *   compress.h  tensor compression              averager.h  averaging, all-reduce
 *   optim.h     collaborative training          masha.h     MASHA extragradient
 *   nn.h        the model kit                   nn_optim.h  its local optimizers
 *   swarm.h     SWARM pipeline parallelism */
#ifndef APIARY_APIARY_H
#define APIARY_APIARY_H

#include "apiary/common.h"
#include "apiary/error.h"
#include "apiary/log.h"
#include "apiary/peer.h"
#include "apiary/identity.h"
#include "apiary/multiaddr.h"
#include "apiary/runtime.h"
#include "apiary/node.h"
#include "apiary/sim.h"
#include "apiary/dht.h"
#include "apiary/compress.h"
#include "apiary/averager.h"
#include "apiary/btard.h"
#include "apiary/optim.h"
#include "apiary/masha.h"
#include "apiary/nn.h"
#include "apiary/nn_optim.h"
#include "apiary/swarm.h"

#endif
