// Acceptance tests of OpenDsec's E2B gateway with the unmodified npm `e2b`
// SDK (node:test): commands, files, watch, PTY, get_host, list paging,
// network, bad input through fetch and API-key isolation.
// scripts/test-e2b.sh sets E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY,
// E2B_NPM_DIR and E2B_TEST_OTHER_KEY.
import test from 'node:test'
import assert from 'node:assert/strict'
import { createRequire } from 'node:module'

const require = createRequire(process.env.E2B_NPM_DIR + '/')
const {
  Sandbox, CommandExitError, TimeoutError, NotFoundError, FileNotFoundError,
  SandboxError, AuthenticationError, FilesystemEventType,
} = require('e2b')

const API = process.env.E2B_API_URL
const KEY = process.env.E2B_API_KEY
const OTHER = process.env.E2B_TEST_OTHER_KEY
const BASE = process.env.E2B_SANDBOX_URL

async function until (cond, what, ms = 20000) {
  const end = Date.now() + ms
  for (;;) {
    const v = await cond()
    if (v) return v
    if (Date.now() > end) throw new Error('timed out waiting for ' + what)
    await new Promise((resolve) => setTimeout(resolve, 50))
  }
}

async function withSandbox (opts, fn) {
  const sbx = await Sandbox.create(opts)
  try {
    return await fn(sbx)
  } finally {
    await sbx.kill()
  }
}

const api = (method, path, { key = KEY, body } = {}) => fetch(API + path, {
  method,
  headers: { ...(key ? { 'X-API-Key': key } : {}), 'Content-Type': 'application/json' },
  body,
})

async function listIds (key = KEY) {
  const r = await api('GET', '/v2/sandboxes', { key })
  assert.equal(r.status, 200)
  return (await r.json()).map((s) => s.sandboxID).sort()
}

test('commands: background, stdin, connect, list, kill, user, cwd, env, timeout', async () => {
  await withSandbox({ envs: { WIDE: 'w' } }, async (sbx) => {
    const cat = await sbx.commands.run('cat', { background: true, stdin: true })
    await sbx.commands.sendStdin(cat.pid, 'one\n')
    await sbx.commands.sendStdin(cat.pid, 'two\n')
    await sbx.commands.closeStdin(cat.pid)
    assert.equal((await cat.wait()).stdout, 'one\ntwo\n')

    const bg = await sbx.commands.run('sleep 0.3; echo later', { background: true })
    const again = await sbx.commands.connect(bg.pid)
    assert.equal((await again.wait()).stdout, 'later\n')
    await assert.rejects(sbx.commands.connect(999999), (e) => e instanceof SandboxError)

    const long = await sbx.commands.run('sleep 600', { background: true, envs: { L: '1' }, cwd: '/tmp' })
    const listed = (await sbx.commands.list()).find((p) => p.pid === long.pid)
    assert.ok(listed, 'the background process is listed')
    assert.equal(listed.envs.L, '1')
    assert.equal(listed.cwd, '/tmp')
    assert.equal(await sbx.commands.kill(long.pid), true)
    await assert.rejects(long.wait(), (e) => e instanceof CommandExitError)
    assert.equal(await sbx.commands.kill(long.pid), false)

    assert.equal((await sbx.commands.run('id -un; pwd', { user: 'root', cwd: '/' })).stdout, 'root\n/\n')
    assert.equal((await sbx.commands.run('echo $WIDE-$X', { envs: { X: 'y' } })).stdout, 'w-y\n')
    await assert.rejects(sbx.commands.run('echo out; exit 9'), (e) => e instanceof CommandExitError && e.exitCode === 9 && e.stdout === 'out\n')
    await assert.rejects(sbx.commands.run('sleep 30', { timeoutMs: 1000 }), (e) => e instanceof TimeoutError)
    const got = []
    await sbx.commands.run('echo a; echo b >&2', { onStdout: (d) => got.push('o:' + d), onStderr: (d) => got.push('e:' + d) })
    assert.deepEqual(got.sort(), ['e:b\n', 'o:a\n'])
  })
})

test('files: text, bytes, many, list depth, info, make dir, rename, remove, urls', async () => {
  await withSandbox({}, async (sbx) => {
    await sbx.files.write([{ path: 'm/a.txt', data: 'A' }, { path: '/tmp/m/b.bin', data: new Uint8Array([0, 255]) }])
    assert.equal(await sbx.files.read('m/a.txt'), 'A')
    assert.deepEqual([...await sbx.files.read('/tmp/m/b.bin', { format: 'bytes' })], [0, 255])
    assert.equal(await (await sbx.files.read('m/a.txt', { format: 'blob' })).text(), 'A')
    await sbx.files.write('m/deep/er/c.txt', 'C')
    assert.deepEqual((await sbx.files.list('m')).map((e) => e.name).sort(), ['a.txt', 'deep'])
    assert.deepEqual((await sbx.files.list('m', { depth: 3 })).map((e) => e.path).sort(),
      ['/home/user/m/a.txt', '/home/user/m/deep', '/home/user/m/deep/er', '/home/user/m/deep/er/c.txt'])
    const info = await sbx.files.getInfo('m/a.txt')
    assert.equal(info.size, 1)
    assert.equal(info.type, 'file')
    assert.equal(info.owner, 'user')
    assert.equal(info.permissions, '-rw-r--r--')
    assert.equal(await sbx.files.makeDir('m/new/dir'), true)
    assert.equal(await sbx.files.makeDir('m/new/dir'), false)
    assert.equal((await sbx.files.rename('m/a.txt', 'm/new/a.txt')).path, '/home/user/m/new/a.txt')
    assert.equal(await sbx.files.exists('m/a.txt'), false)
    await sbx.files.remove('m/new')
    assert.equal(await sbx.files.exists('m/new/a.txt'), false)
    await assert.rejects(sbx.files.read('m/missing'), (e) => e instanceof FileNotFoundError)
    await assert.rejects(sbx.files.getInfo('m/missing'), (e) => e instanceof NotFoundError)

    const up = await sbx.uploadUrl('/tmp/up.txt', { useSignatureExpiration: 60_000 })
    const form = new FormData()
    form.append('file', new Blob(['via url']), 'up.txt')
    assert.equal((await fetch(up, { method: 'POST', body: form })).status, 200)
    const down = await sbx.downloadUrl('/tmp/up.txt', { useSignatureExpiration: 60_000 })
    assert.equal(await (await fetch(down)).text(), 'via url')
    const expired = await sbx.downloadUrl('/tmp/up.txt', { useSignatureExpiration: -10_000 })
    const r = await fetch(expired)
    assert.equal(r.status, 401)
    assert.deepEqual(await r.json(), { code: 401, message: 'signature is already expired' })
  })
})

test('watchDir: create, write, remove, recursive', async () => {
  await withSandbox({}, async (sbx) => {
    await sbx.files.makeDir('wd/sub')
    const events = []
    const h = await sbx.files.watchDir('wd', (e) => events.push(e), { recursive: true })
    try {
      await sbx.files.write('wd/f.txt', 'x')
      await sbx.files.write('wd/sub/g.txt', 'y')
      await sbx.files.remove('wd/f.txt')
      const has = (name, type) => events.some((e) => e.name === name && e.type === type)
      await until(() => has('f.txt', FilesystemEventType.CREATE) && has('f.txt', FilesystemEventType.WRITE) &&
        has('sub/g.txt', FilesystemEventType.CREATE) && has('f.txt', FilesystemEventType.REMOVE), 'watch events')
      assert.ok(!events.some((e) => e.name.includes('.opendsec-upload-')), 'no temp files in events')
      // envd's order for a write: create (new files only), chmod, write.
      const of = (name) => events.filter((e) => e.name === name).map((e) => e.type)
      assert.deepEqual(of('sub/g.txt'), [FilesystemEventType.CREATE, FilesystemEventType.CHMOD, FilesystemEventType.WRITE])
      const before = events.length
      await sbx.files.write('wd/sub/g.txt', 'z')
      await until(() => events.length >= before + 2, 'events of a second write')
      assert.deepEqual(events.slice(before).map((e) => [e.name, e.type]),
        [['sub/g.txt', FilesystemEventType.CHMOD], ['sub/g.txt', FilesystemEventType.WRITE]])
    } finally {
      await h.stop()
    }
    await assert.rejects(sbx.files.watchDir('nope', () => {}), (e) => e instanceof NotFoundError)
  })
})

test('pty: create, input, resize, kill', async () => {
  await withSandbox({}, async (sbx) => {
    const chunks = []
    const dec = new TextDecoder()
    const pty = await sbx.pty.create({ cols: 80, rows: 24, onData: (d) => chunks.push(dec.decode(d)) })
    await sbx.pty.sendInput(pty.pid, new TextEncoder().encode('echo js-$((6*7))\n'))
    await sbx.pty.resize(pty.pid, { cols: 99, rows: 41 })
    await sbx.pty.sendInput(pty.pid, new TextEncoder().encode('stty size; exit\n'))
    await pty.wait()
    const out = chunks.join('')
    assert.match(out, /js-42/)
    assert.match(out, /41 99/)
    const k = await sbx.pty.create({ cols: 10, rows: 10, onData: () => {} })
    assert.equal(await sbx.pty.kill(k.pid), true)
    await assert.rejects(k.wait(), (e) => e instanceof CommandExitError)
  })
})

test('getHost: header and Host routing to http.server', async () => {
  await withSandbox({}, async (sbx) => {
    await sbx.commands.run('mkdir -p /tmp/js && echo from-js > /tmp/js/x.txt && cd /tmp/js && python3 -m http.server 8125', { background: true })
    const host = sbx.getHost(8125)
    assert.equal(host, `8125-${sbx.sandboxId}.${process.env.E2B_DOMAIN}`)
    // fetch will not set Host; node:http will.
    const http = await import('node:http')
    const get = (headers) => new Promise((resolve, reject) => {
      const u = new URL(BASE + '/x.txt')
      http.get({ host: u.hostname, port: u.port, path: u.pathname, headers }, (res) => {
        let body = ''
        res.on('data', (d) => { body += d })
        res.on('end', () => resolve({ status: res.statusCode, body }))
      }).on('error', reject)
    })
    const r = await until(async () => { const r = await get({ Host: host }); return r.status === 200 && r }, 'http.server')
    assert.equal(r.body, 'from-js\n')
    const h = await get({ 'E2b-Sandbox-Id': sbx.sandboxId, 'E2b-Sandbox-Port': '8125' })
    assert.equal(h.status, 200)
    assert.equal(h.body, 'from-js\n')
  })
})

test('list paginator, metadata filter, info, setTimeout, isRunning', async () => {
  const tag = 'js' + Date.now()
  const a = await Sandbox.create({ metadata: { tag } })
  const b = await Sandbox.create({ metadata: { tag } })
  try {
    const pager = Sandbox.list({ query: { metadata: { tag } }, limit: 1 })
    const first = await pager.nextItems()
    assert.equal(pager.hasNext, true)
    const second = await pager.nextItems()
    assert.deepEqual([...first, ...second].map((s) => s.sandboxId), [b.sandboxId, a.sandboxId])
    assert.equal(pager.hasNext, false)
    assert.deepEqual(await Sandbox.list({ query: { metadata: { tag }, state: ['paused'] } }).nextItems(), [])
    const info = await a.getInfo()
    assert.deepEqual(info.metadata, { tag })
    assert.equal(info.state, 'running')
    assert.ok(info.endAt instanceof Date)
    await a.setTimeout(1000)
    await until(async () => !(await a.isRunning()), 'a to time out')
    await assert.rejects(Sandbox.getInfo(a.sandboxId), (e) => e instanceof NotFoundError)
  } finally {
    await Sandbox.kill(a.sandboxId)
    await b.kill()
  }
})

test('network: allowInternetAccess, updateNetwork, traffic token', async () => {
  await withSandbox({ allowInternetAccess: false, network: { allowPublicTraffic: false } }, async (sbx) => {
    assert.equal((await sbx.getInfo()).allowInternetAccess, false)
    await sbx.updateNetwork({})
    assert.equal((await sbx.getInfo()).allowInternetAccess, true)
    await assert.rejects(sbx.updateNetwork({ denyOut: ['bad'] }), (e) => e instanceof SandboxError)
    assert.ok(sbx.trafficAccessToken)
    await sbx.commands.run('cd /tmp && python3 -m http.server 8126', { background: true })
    const hdr = { 'E2b-Sandbox-Id': sbx.sandboxId, 'E2b-Sandbox-Port': '8126' }
    await until(async () => (await fetch(BASE + '/', { headers: { ...hdr, 'e2b-traffic-access-token': sbx.trafficAccessToken } })).status === 200, 'http.server')
    assert.equal((await fetch(BASE + '/', { headers: hdr })).status, 403)
  })
})

test('bad input through fetch: E2B-shaped errors, nothing made', async () => {
  const before = await listIds()
  const cases = [
    ['{"templateID":', 400],
    ['{"templateID":"no-such-template-js"}', 404],
    ['{"templateID":"base","timeout":0}', 400],
    ['{"templateID":"base","timeout":100000000}', 400],
    [JSON.stringify({ templateID: 'base', metadata: Object.fromEntries(Array.from({ length: 500 }, (_, i) => ['k' + i, 'v'])) }), 400],
  ]
  for (const [body, status] of cases) {
    const r = await api('POST', '/v2/sandboxes', { body })
    assert.equal(r.status, status, body.slice(0, 60))
    const e = await r.json()
    assert.equal(e.code, status)
    assert.equal(typeof e.message, 'string')
  }
  assert.deepEqual(await listIds(), before)
  await assert.rejects(Sandbox.create('no-such-template-js'), (e) => e instanceof SandboxError)
  await assert.rejects(Sandbox.create({ apiKey: 'e2b_' + '3'.repeat(40) }), (e) => e instanceof AuthenticationError)
  await assert.rejects(Sandbox.connect('n001aaaaaaaaaaaaaaaa'), (e) => e instanceof NotFoundError)
})

test('api keys are isolated', async () => {
  assert.ok(OTHER, 'E2B_TEST_OTHER_KEY is set by scripts/test-e2b.sh')
  await withSandbox({}, async (sbx) => {
    assert.ok(!(await listIds(OTHER)).includes(sbx.sandboxId))
    await assert.rejects(Sandbox.getInfo(sbx.sandboxId, { apiKey: OTHER }), (e) => e instanceof NotFoundError)
    await assert.rejects(Sandbox.connect(sbx.sandboxId, { apiKey: OTHER }), (e) => e instanceof NotFoundError)
    assert.equal(await Sandbox.kill(sbx.sandboxId, { apiKey: OTHER }), false)
    assert.equal(await sbx.isRunning(), true)
  })
})
