// Mastra's E2B workspace (npm @mastra/e2b's E2BSandbox in @mastra/core's
// Workspace), unpatched, with its documented defaults: `new E2BSandbox()`
// and nothing else, the E2B variables set as for E2B. By default it looks
// its template up (`GET /templates/aliases/mastra-<hash>`), builds it when
// missing (`Template().fromTemplate('base').aptInstall(['s3fs', 'fuse'])`:
// POST /v3/templates, the build, its status) and starts its sandbox from
// it with `lifecycle: {onTimeout: 'pause'}` and a `mastra-sandbox-id`
// metadata it finds the sandbox by. scripts/test-e2b-clients.sh sets the
// environment and serves the Debian archive the build's apt-get reaches.
import test from 'node:test'
import assert from 'node:assert/strict'
import { createHash } from 'node:crypto'
import { readFileSync } from 'node:fs'
import { createRequire } from 'node:module'

const require = createRequire(process.env.E2B_NPM_DIR + '/')
const { Workspace } = require('@mastra/core/workspace')
const { E2BSandbox } = require('@mastra/e2b')
const { Template } = require('e2b')

const API = process.env.E2B_API_URL
const KEY = process.env.E2B_API_KEY

// Every sandbox of the key, running or paused, through the gateway.
async function sandboxes () {
  const r = await fetch(API + '/v2/sandboxes?state=running,paused', { headers: { 'X-API-Key': KEY } })
  assert.equal(r.status, 200)
  return (await r.json()).map((s) => ({ id: s.sandboxID, state: s.state, templateID: s.templateID, alias: s.alias, metadata: s.metadata ?? {} }))
}

// The name Mastra gives its default template (createDefaultMountableTemplate).
const DEFAULT_TEMPLATE = 'mastra-' + createHash('sha256')
  .update(JSON.stringify({ aptPackages: ['s3fs', 'fuse'], version: 'v1' })).digest('hex').slice(0, 16)

const mirrorRequests = () => readFileSync(process.env.E2B_TEST_MIRROR_LOG, 'utf8').split('\n').filter(Boolean)

test('Mastra: a Workspace with new E2BSandbox() builds its default template, runs, writes, reads and tears down', async () => {
  assert.deepEqual(await sandboxes(), [])
  assert.equal(await Template.exists(DEFAULT_TEMPLATE), false)
  const sandbox = new E2BSandbox()
  const workspace = new Workspace({ sandbox })
  try {
    await workspace.init()
    assert.equal(sandbox.status, 'running')

    // The default template was built here, from the Debian archive the
    // operator allows builds (apt-get reached it for s3fs), and started.
    assert.ok(mirrorRequests().some((l) => /^GET \/debian\/pool\/main\/s\/s3fs-fuse\/s3fs_.*\.deb 200$/.test(l)), 'the build fetched s3fs')
    const listed = await sandboxes()
    assert.equal(listed.length, 1)
    assert.equal(listed[0].id, sandbox.e2b.sandboxId)
    assert.equal(listed[0].metadata['mastra-sandbox-id'], sandbox.id)
    // Mastra starts it by the ID its build returned; the alias route
    // answers that ID for the name, and the sandbox carries both.
    const alias = await fetch(API + '/templates/aliases/' + DEFAULT_TEMPLATE, { headers: { 'X-API-Key': KEY } })
    assert.equal(alias.status, 200)
    assert.equal((await alias.json()).templateID, listed[0].templateID)
    assert.equal(listed[0].alias, DEFAULT_TEMPLATE)

    const r = await sandbox.executeCommand('echo', ['hello from mastra'])
    assert.equal(r.exitCode, 0)
    assert.equal(r.stdout, 'hello from mastra\n')
    assert.equal(r.success, true)
    const who = await sandbox.executeCommand('id -un && pwd && command -v s3fs')
    assert.equal(who.stdout, 'user\n/home/user\n/usr/bin/s3fs\n')
    const bad = await sandbox.executeCommand('echo oops >&2; exit 3')
    assert.equal(bad.exitCode, 3)
    // Mastra's handle adds the SDK error's stderr to the stderr it
    // streamed (E2BProcessHandle.wait), so a failed command's stderr comes
    // twice, against E2B too.
    assert.equal(bad.stderr, 'oops\noops\n')
    assert.equal(bad.success, false)

    await sandbox.writeFiles([
      { path: '/home/user/notes/a.txt', content: 'written by mastra\n' },
      { path: '/home/user/notes/b.bin', content: Buffer.from([0, 1, 2, 255]) },
    ])
    assert.equal((await sandbox.executeCommand('cat', ['/home/user/notes/a.txt'])).stdout, 'written by mastra\n')
    assert.equal((await sandbox.executeCommand('od -An -tu1 /home/user/notes/b.bin')).stdout.trim().split(/\s+/).join(','), '0,1,2,255')
    assert.equal(await sandbox.e2b.files.read('/home/user/notes/a.txt'), 'written by mastra\n')

    // workspace.stop() pauses the sandbox (what Mastra.shutdown() does);
    // the next command starts it again: Mastra finds it by its metadata
    // and resumes it (Sandbox.connect), files and all.
    const id = sandbox.e2b.sandboxId
    await workspace.stop()
    assert.deepEqual((await sandboxes()).map((s) => [s.id, s.state]), [[id, 'paused']])
    assert.equal((await sandbox.executeCommand('cat /home/user/notes/a.txt')).stdout, 'written by mastra\n')
    assert.equal(sandbox.e2b.sandboxId, id)
    assert.deepEqual((await sandboxes()).map((s) => [s.id, s.state]), [[id, 'running']])
  } finally {
    await workspace.destroy()
  }
  assert.deepEqual(await sandboxes(), [], 'destroy leaves no sandbox')
})

test('Mastra: a second workspace finds the built template and builds nothing', async () => {
  const before = mirrorRequests().length
  const sandbox = new E2BSandbox()
  const workspace = new Workspace({ sandbox })
  try {
    await workspace.init()
    const r = await sandbox.executeCommand('command -v s3fs')
    assert.equal(r.stdout, '/usr/bin/s3fs\n')
    // This time Mastra starts it by name (Template.exists was true).
    const [{ templateID, alias }] = await sandboxes()
    assert.match(templateID, /^tpl-/)
    assert.equal(alias, DEFAULT_TEMPLATE)
    assert.equal(await Template.exists(DEFAULT_TEMPLATE), true)
    // Stopped (paused) and not started again: destroy() finds the paused
    // sandbox by its metadata and kills it.
    await workspace.stop()
    assert.deepEqual((await sandboxes()).map((s) => s.state), ['paused'])
  } finally {
    await workspace.destroy()
  }
  assert.equal(mirrorRequests().length, before, 'no second build reached the archive')
  assert.deepEqual(await sandboxes(), [])
})
