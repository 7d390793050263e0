// Acceptance test of OpenDsec's E2B gateway with the unmodified npm `e2b`
// SDK (node:test). scripts/test-e2b.sh sets E2B_API_URL, E2B_SANDBOX_URL,
// E2B_API_KEY and NODE_PATH to the pinned install.
import test from 'node:test'
import assert from 'node:assert/strict'
import { createRequire } from 'node:module'

const require = createRequire(process.env.E2B_NPM_DIR + '/')
const { Sandbox, CommandExitError, AuthenticationError, SandboxNotFoundError, NotFoundError } = require('e2b')

test('lifecycle, commands and files', async () => {
  const sbx = await Sandbox.create({ metadata: { js: 'yes' }, envs: { WIDE: 'w' } })
  try {
    const info = await sbx.getInfo()
    assert.equal(info.sandboxId, sbx.sandboxId)
    assert.deepEqual(info.metadata, { js: 'yes' })
    assert.equal(await sbx.isRunning(), true)

    const r = await sbx.commands.run('echo $WIDE $X; pwd; whoami', { envs: { X: 'x' } })
    assert.equal(r.stdout, 'w x\n/home/user\nuser\n')
    await assert.rejects(sbx.commands.run('exit 4'), (e) => e instanceof CommandExitError && e.exitCode === 4)
    const bg = await sbx.commands.run('sleep 600', { background: true })
    assert.equal(await sbx.commands.kill(bg.pid), true)

    await sbx.files.write('dir/a.txt', 'from js')
    assert.equal(await sbx.files.read('dir/a.txt'), 'from js')
    assert.deepEqual((await sbx.files.list('dir')).map((e) => e.name), ['a.txt'])
    assert.equal(await sbx.files.exists('dir/nope'), false)
    await assert.rejects(sbx.files.read('missing.txt'), (e) => e instanceof NotFoundError)

    const same = await Sandbox.connect(sbx.sandboxId)
    assert.equal((await same.commands.run('echo again')).stdout, 'again\n')
    const page = await Sandbox.list({ query: { metadata: { js: 'yes' } } }).nextItems()
    assert.deepEqual(page.map((s) => s.sandboxId), [sbx.sandboxId])
  } finally {
    await sbx.kill()
  }
  assert.equal(await sbx.isRunning(), false)
  assert.equal(await Sandbox.kill(sbx.sandboxId), false)
  await assert.rejects(Sandbox.connect(sbx.sandboxId), (e) => e instanceof SandboxNotFoundError || e instanceof NotFoundError)
})

test('wrong key', async () => {
  await assert.rejects(Sandbox.create({ apiKey: 'e2b_' + '0'.repeat(40) }), (e) => e instanceof AuthenticationError)
})
