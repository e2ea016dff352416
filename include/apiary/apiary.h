/* Apiary — the whole public API in one include. Each header below documents
 * its part and is named for the prefix of its names (ap_collab_* in
 * collab.h, AP_COLLAB_* too); include only the ones a program uses if it
 * prefers.
 *   common.h     version, export macros       error.h      error codes
 *   log.h        logging                      peer.h       peer identities
 *   identity.h   key pairs and key files      multiaddr.h  network addresses
 *   runtime.h    the runtime interface        sim.h        the network simulator
 *   host.h       libuv hosts (loops)          node.h       nodes on a host
 *   sync.h       completing a blocking call   dht.h        the Kademlia DHT
 *   compress.h   tensor compression           avg.h        averaging: balance, groups,
 *   allreduce.h  one all-reduce round                      service, matchmaking
 *   averager.h   the Averager                 btard.h      BTARD building blocks
 *   run_config.h a run's shared configuration progress.h   progress records
 *   run_token.h  closed runs: join tokens
 *   collab.h     the collaborative optimizer  masha.h      MASHA extragradient
 *   nn.h         the model kit (models, solvers, schedules, checkpoints)
 *   swarm.h      SWARM pipeline parallelism */
#ifndef APIARY_APIARY_H
#define APIARY_APIARY_H

#include "apiary/common.h"
#include "apiary/error.h"
#include "apiary/log.h"
#include "apiary/peer.h"
#include "apiary/identity.h"
#include "apiary/multiaddr.h"
#include "apiary/runtime.h"
#include "apiary/host.h"
#include "apiary/sync.h"
#include "apiary/node.h"
#include "apiary/sim.h"
#include "apiary/dht.h"
#include "apiary/compress.h"
#include "apiary/avg.h"
#include "apiary/allreduce.h"
#include "apiary/averager.h"
#include "apiary/btard.h"
#include "apiary/run_config.h"
#include "apiary/run_token.h"
#include "apiary/progress.h"
#include "apiary/collab.h"
#include "apiary/masha.h"
#include "apiary/nn.h"
#include "apiary/swarm.h"

#endif
