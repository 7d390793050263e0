// The real E2B JS SDK (npm e2b, scripts/test-e2b.sh's pin) over TLS with
// E2B's own endpoint resolution (node:test). scripts/test-e2b-tls.sh starts
// a system whose gateway serves TLS and HTTP/2 (a certificate from
// OpenDsec's CA, trusted through NODE_EXTRA_CA_CERTS) on
// E2B_TEST_GATEWAY_IP:443 and runs this with only E2B_DOMAIN and
// E2B_API_KEY set: the SDK calls https://api.<domain> and
// https://<port>-<id>.<domain> (its undici agent allows h2). Those names
// resolve through the DNS server below, on E2B_TEST_GATEWAY_IP:53, which
// the script makes the process's only nameserver (a private mount
// namespace with its own /etc/resolv.conf).
import test from 'node:test'
import assert from 'node:assert/strict'
import dgram from 'node:dgram'
import tls from 'node:tls'
import { readFileSync } from 'node:fs'
import { createRequire } from 'node:module'

for (const v of ['E2B_API_URL', 'E2B_SANDBOX_URL']) {
  if (process.env[v]) throw new Error(`${v} is set; this suite tests the SDK's own https://<host> resolution`)
}
for (const v of ['E2B_DOMAIN', 'E2B_API_KEY', 'E2B_TEST_GATEWAY_IP', 'NODE_EXTRA_CA_CERTS', 'E2B_NPM_DIR']) {
  if (!process.env[v]) throw new Error(`${v} is not set; run scripts/test-e2b-tls.sh`)
}
const require = createRequire(process.env.E2B_NPM_DIR + '/')
const { Sandbox, TimeoutError } = require('e2b')
const DOMAIN = process.env.E2B_DOMAIN.toLowerCase().replace(/\.$/, '')
const IP = process.env.E2B_TEST_GATEWAY_IP

// dnsAnswer answers one query: DOMAIN and every name under it are IP (A;
// no AAAA); any other name is refused.
function dnsAnswer (q) {
  let i = 12
  const labels = []
  while (q[i]) {
    labels.push(q.subarray(i + 1, i + 1 + q[i]).toString('latin1').toLowerCase())
    i += 1 + q[i]
  }
  const qtype = q.readUInt16BE(i + 1)
  const name = labels.join('.')
  const ours = name === DOMAIN || name.endsWith('.' + DOMAIN)
  const answer = ours && qtype === 1
    ? Buffer.concat([Buffer.from([0xc0, 0x0c, 0, 1, 0, 1, 0, 0, 0, 5, 0, 4]), Buffer.from(IP.split('.').map(Number))])
    : Buffer.alloc(0)
  const hdr = Buffer.alloc(12)
  q.copy(hdr, 0, 0, 2)
  hdr.writeUInt16BE(0x8000 | 0x0400 | (q.readUInt16BE(2) & 0x0100) | 0x0080 | (ours ? 0 : 5), 2)
  hdr.writeUInt16BE(1, 4)
  hdr.writeUInt16BE(answer.length ? 1 : 0, 6)
  return Buffer.concat([hdr, q.subarray(12, i + 5), answer])
}

const queries = []
const dns = dgram.createSocket('udp4')
dns.on('message', (q, peer) => {
  try {
    dns.send(dnsAnswer(q), peer.port, peer.address)
    queries.push(q)
  } catch {} // a malformed query gets no answer
})
await new Promise((resolve, reject) => { dns.once('error', reject); dns.bind(53, IP, resolve) })
test.after(() => dns.close())

test('https hosts: create, getHost, commands, files, a user port', async () => {
  const sbx = await Sandbox.create()
  try {
    assert.equal(sbx.connectionConfig.apiUrl, `https://api.${DOMAIN}`)
    const host = sbx.getHost(49983)
    assert.equal(host, `49983-${sbx.sandboxId}.${DOMAIN}`)
    assert.equal(sbx.envdApiUrl, `https://${host}`)

    const r = await sbx.commands.run('echo hello over tls; echo err >&2')
    assert.deepEqual([r.exitCode, r.stdout, r.stderr], [0, 'hello over tls\n', 'err\n'])
    await sbx.files.write('/tmp/tls.txt', 'written over h2')
    assert.equal(await sbx.files.read('/tmp/tls.txt'), 'written over h2')
    assert.equal(await sbx.isRunning(), true)

    // A server in the sandbox, reached at https://8080-<id>.<domain> with
    // the CA of NODE_EXTRA_CA_CERTS.
    await sbx.files.write('/tmp/www/index.html', 'from the sandbox')
    await sbx.commands.run('cd /tmp/www && python3 -m http.server 8080', { background: true })
    const url = `https://${sbx.getHost(8080)}/index.html`
    const deadline = Date.now() + 20000
    for (;;) {
      const res = await fetch(url).catch((e) => e)
      if (res.status === 200) {
        assert.equal(await res.text(), 'from the sandbox')
        break
      }
      assert.ok(Date.now() < deadline, `no 200 from ${url}: ${res.status ?? res}`)
      await new Promise((resolve) => setTimeout(resolve, 100))
    }
    // The API's and the sandbox's names went through the test's resolver.
    assert.ok(queries.length >= 3, `${queries.length} DNS queries`)
  } finally {
    await sbx.kill()
  }
})

test('the gateway negotiates h2 for a sandbox host', async () => {
  const host = `49983-n001aaaaaaaaaaaaaaaa.${DOMAIN}`
  const sock = tls.connect({ host: IP, port: 443, servername: host, ALPNProtocols: ['h2', 'http/1.1'], ca: readFileSync(process.env.NODE_EXTRA_CA_CERTS) })
  await new Promise((resolve, reject) => { sock.once('secureConnect', resolve); sock.once('error', reject) })
  try {
    assert.equal(sock.alpnProtocol, 'h2')
    assert.equal(sock.authorized, true)
  } finally {
    sock.destroy()
  }
})

test('a kill under a running command is the SDK\'s "sandbox was killed" error', async () => {
  const sbx = await Sandbox.create()
  try {
    const started = Date.now()
    const killer = setTimeout(() => Sandbox.kill(sbx.sandboxId), 1500)
    await assert.rejects(sbx.commands.run('sleep 60'), (e) => {
      assert.ok(e instanceof TimeoutError, `${e?.name}: ${e?.message}`)
      assert.match(e.message, /The sandbox was killed or reached its end of life while the request was in flight/)
      return true
    })
    clearTimeout(killer)
    assert.ok(Date.now() - started < 20000)
    assert.equal(await Sandbox.kill(sbx.sandboxId), false, 'the sandbox is gone')
  } finally {
    await Sandbox.kill(sbx.sandboxId).catch(() => {})
  }
})
