// Sandbox.fork with the unmodified npm `e2b` SDK (node:test); see
// smoke.test.mjs for the setup. OpenDsec's container forks copy files, not
// memory: each fork's processes start again.
import test from 'node:test'
import assert from 'node:assert/strict'
import { createRequire } from 'node:module'

const require = createRequire(process.env.E2B_NPM_DIR + '/')
const { Sandbox, SandboxNotFoundError } = require('e2b')

test('fork copies files; writes stay apart', async () => {
  const sbx = await Sandbox.create({ envs: { WIDE: 'yes' } })
  let forks = []
  try {
    await sbx.files.write('state.txt', 'step-1') // home directory: on the root filesystem
    forks = await sbx.fork({ count: 3, timeoutMs: 120_000 })
    assert.equal(forks.length, 3)
    for (const f of forks) {
      assert.ok(f instanceof Sandbox, String(f))
      assert.notEqual(f.sandboxId, sbx.sandboxId)
      assert.equal(await f.files.read('state.txt'), 'step-1')
      assert.equal((await f.commands.run('echo $WIDE')).stdout, 'yes\n')
    }
    assert.equal(new Set(forks.map((f) => f.sandboxId)).size, 3)
    await forks[0].files.write('state.txt', 'fork-0')
    for (const other of [sbx, ...forks.slice(1)]) {
      assert.equal(await other.files.read('state.txt'), 'step-1')
    }
    const [again] = await Sandbox.fork(sbx.sandboxId)
    assert.ok(again instanceof Sandbox)
    forks.push(again)
  } finally {
    await Promise.all([sbx, ...forks].filter((s) => s instanceof Sandbox).map((s) => s.kill()))
  }
})

test('fork of an unknown sandbox is SandboxNotFoundError', async () => {
  await assert.rejects(Sandbox.fork('nosuchsandbox0000000'), SandboxNotFoundError)
})
