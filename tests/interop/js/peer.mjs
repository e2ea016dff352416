// A js-libp2p peer for Apiary's interoperability tests.
//   node peer.mjs listen          prints {"peer","addr"} and serves identify and
//                                 ping until stdin closes
//   node peer.mjs dial MULTIADDR  pings 3 times, runs identify, prints one JSON
//                                 line {"ok", "rtts", "peer", "agent", ...}
import { createLibp2p } from 'libp2p'
import { tcp } from '@libp2p/tcp'
import { noise } from '@chainsafe/libp2p-noise'
import { yamux } from '@chainsafe/libp2p-yamux'
import { identify } from '@libp2p/identify'
import { ping } from '@libp2p/ping'
import { multiaddr } from '@multiformats/multiaddr'

// Node 20 lacks Promise.withResolvers (Node 22), which it-queue calls.
if (typeof Promise.withResolvers !== 'function') {
  Promise.withResolvers = function () {
    let resolve, reject
    const promise = new this((res, rej) => { resolve = res; reject = rej })
    return { promise, resolve, reject }
  }
}

const [mode, target] = process.argv.slice(2)
const node = await createLibp2p({
  addresses: { listen: mode === 'listen' ? ['/ip4/127.0.0.1/tcp/0'] : [] },
  transports: [tcp()],
  connectionEncrypters: [noise()],
  streamMuxers: [yamux()],
  services: { identify: identify(), ping: ping() }
})

if (mode === 'listen') {
  const addr = node.getMultiaddrs()[0].toString()
  console.log(JSON.stringify({ peer: node.peerId.toString(), addr }))
  process.stdin.resume()
  process.stdin.on('end', async () => { await node.stop(); process.exit(0) })
} else {
  const out = { ok: false }
  try {
    const ma = multiaddr(target)
    const conn = await node.dial(ma)
    out.peer = conn.remotePeer.toString()
    out.muxer = conn.multiplexer
    out.encryption = conn.encryption
    out.rtts = []
    for (let i = 0; i < 3; i++) out.rtts.push(await node.services.ping.ping(ma))
    const id = await node.services.identify.identify(conn)
    out.agent = id.agentVersion
    out.protocol_version = id.protocolVersion
    out.protocols = id.protocols
    out.listen_addrs = id.listenAddrs.map(a => a.toString())
    out.observed_addr = id.observedAddr ? id.observedAddr.toString() : null
    out.key_matches = id.peerId.toString() === out.peer
    out.ok = true
  } catch (e) {
    out.error = String(e && e.message ? e.message : e)
  }
  console.log(JSON.stringify(out))
  await node.stop()
  process.exit(out.ok ? 0 : 1)
}
