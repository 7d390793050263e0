// Snapshots with the unmodified npm `e2b` SDK (node:test): createSnapshot,
// a snapshot ID as Sandbox.create's template, listSnapshots and
// deleteSnapshot; see smoke.test.mjs for the setup.
import test from 'node:test'
import assert from 'node:assert/strict'
import { createRequire } from 'node:module'

const require = createRequire(process.env.E2B_NPM_DIR + '/')
const { Sandbox } = require('e2b')

test('createSnapshot, create from it, list, delete', async () => {
  const sbx = await Sandbox.create({ envs: { FROM_SRC: 'yes' } })
  const name = 'js-' + Math.random().toString(36).slice(2, 10)
  try {
    await sbx.files.write('/home/user/state.txt', 'saved')
    const info = await sbx.createSnapshot({ name })
    assert.ok(info.snapshotId)
    assert.deepEqual(info.names, [name])
    assert.equal(await sbx.isRunning(), true)

    const fork = await Sandbox.create(info.snapshotId)
    try {
      assert.equal(await fork.files.read('/home/user/state.txt'), 'saved')
      assert.equal((await fork.commands.run('echo $FROM_SRC')).stdout, 'yes\n')
    } finally {
      await fork.kill()
    }
    const mine = await sbx.listSnapshots().nextItems()
    assert.deepEqual(mine.map((s) => s.snapshotId), [info.snapshotId])
    assert.equal(await Sandbox.deleteSnapshot(info.snapshotId), true)
    assert.equal(await Sandbox.deleteSnapshot(info.snapshotId), false)
    await assert.rejects(sbx.createSnapshot({ name: 'team/slash' }), /name/)
  } finally {
    await sbx.kill()
  }
})
