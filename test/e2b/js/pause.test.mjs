// Pause, connect-resumes, betaPause, auto-pause and metrics with the
// unmodified npm `e2b` SDK (node:test); see smoke.test.mjs for the setup.
import test from 'node:test'
import assert from 'node:assert/strict'
import { createRequire } from 'node:module'

const require = createRequire(process.env.E2B_NPM_DIR + '/')
const { Sandbox } = require('e2b')

async function until(cond, what, ms = 30000) {
  const deadline = Date.now() + ms
  while (!(await cond())) {
    if (Date.now() > deadline) throw new Error(`${what} within ${ms} ms`)
    await new Promise((r) => setTimeout(r, 100))
  }
}

test('pause, list paused, connect resumes with memory', async () => {
  const tag = 'p' + Math.random().toString(36).slice(2, 10)
  const sbx = await Sandbox.create({ metadata: { tag } })
  try {
    await sbx.files.write('/tmp/kept.txt', 'kept')
    const bg = await sbx.commands.run('sleep 3600', { background: true })
    assert.equal(await sbx.pause(), true)
    assert.equal(await sbx.isRunning(), false)
    assert.equal(await sbx.betaPause(), false) // already paused: 409
    const paused = await Sandbox.list({ query: { metadata: { tag }, state: ['paused'] } }).nextItems()
    assert.deepEqual(paused.map((s) => [s.sandboxId, s.state]), [[sbx.sandboxId, 'paused']])
    assert.equal((await sbx.getInfo()).state, 'paused')

    const same = await Sandbox.connect(sbx.sandboxId)
    assert.equal(same.sandboxId, sbx.sandboxId)
    assert.equal(await same.isRunning(), true)
    assert.equal(await same.files.read('/tmp/kept.txt'), 'kept')
    assert.equal((await same.commands.run(`kill -0 ${bg.pid} && echo alive`)).stdout, 'alive\n')
  } finally {
    await sbx.kill()
  }
})

test('getMetrics', async () => {
  const sbx = await Sandbox.create()
  try {
    let metrics = []
    await until(async () => (metrics = await sbx.getMetrics()).length > 0, 'a metric')
    const m = metrics[metrics.length - 1]
    assert.ok(m.cpuCount >= 1)
    assert.ok(m.memUsed > 0 && m.memUsed <= m.memTotal, JSON.stringify(m))
    assert.ok(m.diskTotal > 0)
    assert.ok(Math.abs(new Date(m.timestamp).getTime() - Date.now()) < 60000)
    const before = await Sandbox.getMetrics(sbx.sandboxId, { start: new Date(Date.now() - 7200000), end: new Date(Date.now() - 3600000) })
    assert.deepEqual(before, [])
  } finally {
    await sbx.kill()
  }
})

test('auto-pause on timeout', async () => {
  const sbx = await Sandbox.create({ timeoutMs: 2000, lifecycle: { onTimeout: 'pause' } })
  try {
    await until(async () => (await sbx.getInfo()).state === 'paused', 'auto-paused after a 2 s timeout')
    const again = await Sandbox.connect(sbx.sandboxId, { timeoutMs: 60000 })
    assert.equal((await again.commands.run('echo up')).stdout, 'up\n')
  } finally {
    await sbx.kill()
  }
})

test('traffic resumes a paused sandbox without connect', async () => {
  const sbx = await Sandbox.create()
  try {
    await sbx.files.write('/tmp/kept.txt', 'kept')
    const bg = await sbx.commands.run('sleep 3600', { background: true })
    assert.equal(await sbx.pause(), true)
    assert.equal(await sbx.isRunning(), false) // the probe leaves it paused
    assert.equal((await sbx.getInfo()).state, 'paused')
    assert.equal(await sbx.files.read('/tmp/kept.txt'), 'kept')
    assert.equal((await sbx.getInfo()).state, 'running')
    assert.equal(await sbx.pause(), true)
    assert.equal((await sbx.commands.run(`kill -0 ${bg.pid} && echo alive`)).stdout, 'alive\n')
    assert.equal(await sbx.isRunning(), true)
  } finally {
    await sbx.kill()
  }
})

test('filesystem-only pause: pause({keepMemory:false}) and onTimeout keepMemory false', async () => {
  const sleeps = async (s) => (await s.commands.run('pgrep -x sleep || true')).stdout.trim()
  const sbx = await Sandbox.create()
  try {
    await sbx.files.write('/home/user/kept.txt', 'on disk')
    await sbx.commands.run('sleep 3600', { background: true })
    assert.notEqual(await sleeps(sbx), '')
    assert.equal(await sbx.pause({ keepMemory: false }), true)
    assert.equal(await sbx.isRunning(), false)
    assert.equal((await sbx.getInfo()).state, 'paused')
    const same = await Sandbox.connect(sbx.sandboxId)
    assert.equal(same.sandboxId, sbx.sandboxId)
    assert.equal(await same.files.read('/home/user/kept.txt'), 'on disk')
    assert.equal(await sleeps(same), '') // the memory was not kept
  } finally {
    await sbx.kill()
  }
  const auto = await Sandbox.create({ timeoutMs: 8000, lifecycle: { onTimeout: { action: 'pause', keepMemory: false } } })
  try {
    await auto.files.write('/home/user/a.txt', 'a')
    await auto.commands.run('sleep 3600', { background: true })
    assert.notEqual(await sleeps(auto), '')
    await until(async () => (await auto.getInfo()).state === 'paused', 'auto-paused after its 8 s timeout')
    const again = await Sandbox.connect(auto.sandboxId, { timeoutMs: 60000 })
    assert.equal(await again.files.read('/home/user/a.txt'), 'a')
    assert.equal(await sleeps(again), '') // the memory was not kept
  } finally {
    await auto.kill()
  }
})
