// A js-libp2p peer for Apiary's interoperability tests.
//   node peer.mjs listen          prints {"peer","addr"} and serves identify and
//                                 ping until stdin closes
//   node peer.mjs dial MULTIADDR  pings 3 times, runs identify, prints one JSON
//                                 line {"ok", "rtts", "peer", "agent", ...}
//   node peer.mjs echo MULTIADDR SIZE STREAMS [DIALS]
//                                 opens STREAMS concurrent /echo/1.0.0 streams,
//                                 sends SIZE bytes of pattern() on each, checks
//                                 the SHA-256 of what comes back; prints one
//                                 JSON line {"ok", "streams_ok", "ms", "MBps",
//                                 "connect_ms"}; with DIALS after STREAMS it
//                                 then hangs up and dials again DIALS times and
//                                 adds "connect_ms_p50"
// Both modes serve /echo/1.0.0 (every byte sent back, then closed).
import { createLibp2p } from 'libp2p'
import { tcp } from '@libp2p/tcp'
import { noise } from '@chainsafe/libp2p-noise'
import { yamux } from '@chainsafe/libp2p-yamux'
import { identify } from '@libp2p/identify'
import { ping } from '@libp2p/ping'
import { multiaddr } from '@multiformats/multiaddr'
import { createHash } from 'node:crypto'

// Node 20 lacks Promise.withResolvers (Node 22), which it-queue calls.
if (typeof Promise.withResolvers !== 'function') {
  Promise.withResolvers = function () {
    let resolve, reject
    const promise = new this((res, rej) => { resolve = res; reject = rej })
    return { promise, resolve, reject }
  }
}

const ECHO = '/echo/1.0.0'
const LIMITS = { maxInboundStreams: 1024, maxOutboundStreams: 1024 }

// Byte i of stream k: the same formula as the C side (tests/net/test_p2p_js.c).
function pattern (k, size) {
  const b = new Uint8Array(size)
  for (let i = 0; i < size; i++) b[i] = (i ^ (i >>> 8) ^ (i >>> 16) ^ (k * 37)) & 0xff
  return b
}

const [mode, target, sizeArg, streamsArg, dialsArg] = process.argv.slice(2)
const t0 = performance.now()
const node = await createLibp2p({
  addresses: { listen: mode === 'listen' ? ['/ip4/127.0.0.1/tcp/0'] : [] },
  transports: [tcp()],
  connectionEncrypters: [noise()],
  streamMuxers: [yamux({ maxInboundStreams: 1024, maxOutboundStreams: 1024 })],
  // benchmarks dial again and again: no inbound rate limit
  // and a loaded test machine: 256 streams may take long to negotiate
  connectionManager: {
    maxIncomingPendingConnections: 64,
    inboundConnectionThreshold: 100000,
    inboundStreamProtocolNegotiationTimeout: 300000,
    outboundStreamProtocolNegotiationTimeout: 300000
  },
  // its periodic pings close a connection whose answer is late (a slow,
  // sanitized build under load); the tests ping explicitly
  connectionMonitor: { enabled: false },
  services: { identify: identify(), ping: ping() }
})
await node.handle(ECHO, ({ stream }) => { stream.sink(stream.source).catch(() => {}) }, LIMITS)

async function echoOne (conn, k, size) {
  const s = await conn.newStream(ECHO, LIMITS)
  const data = pattern(k, size)
  const want = createHash('sha256').update(data).digest('hex')
  const h = createHash('sha256')
  let got = 0
  const sent = s.sink((async function * () {
    for (let o = 0; o < size; o += 65536) yield data.subarray(o, Math.min(size, o + 65536))
  })())
  for await (const chunk of s.source) {
    for (const b of chunk) { h.update(b); got += b.length }
  }
  await sent
  return got === size && h.digest('hex') === want
}

if (mode === 'echo') {
  const out = { ok: false }
  try {
    const size = Number(sizeArg)
    const n = Number(streamsArg)
    const c0 = performance.now()
    const conn = await node.dial(multiaddr(target))
    out.connect_ms = performance.now() - c0
    out.peer = conn.remotePeer.toString()
    const e0 = performance.now()
    const res = await Promise.all(Array.from({ length: n }, (_, k) => echoOne(conn, k, size)))
    out.ms = performance.now() - e0
    out.streams_ok = res.filter(Boolean).length
    out.MBps = (size * n) / 1e6 / (out.ms / 1000)
    const dials = Number(dialsArg || 0)
    const times = []
    for (let i = 0; i < dials; i++) {
      await node.hangUp(conn.remotePeer)
      const d0 = performance.now()
      await node.dial(multiaddr(target))
      times.push(performance.now() - d0)
    }
    if (dials) {
      times.sort((a, b) => a - b)
      const m = times.length >> 1
      out.connect_ms_p50 = times.length % 2 ? times[m] : (times[m - 1] + times[m]) / 2
    }
    out.ok = out.streams_ok === n
  } catch (e) {
    out.error = String(e && e.message ? e.message : e)
  }
  out.total_ms = performance.now() - t0
  console.log(JSON.stringify(out))
  await node.stop()
  process.exit(out.ok ? 0 : 1)
}

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
