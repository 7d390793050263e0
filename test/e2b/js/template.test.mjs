// Template builds with the unmodified npm `e2b` SDK (node:test): a template
// from `base` with runCmd, a copy of a directory (the JS SDK's files hash
// covers directory sizes), setEnvs, setWorkdir and setStartCmd, started
// with Sandbox.create(name); Template.exists; tags; a failing step.
import test from 'node:test'
import assert from 'node:assert/strict'
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { createRequire } from 'node:module'

const require = createRequire(process.env.E2B_NPM_DIR + '/')
const { Sandbox, Template, BuildError, waitForPort } = require('e2b')

const API = process.env.E2B_API_URL.replace(/\/$/, '')
const KEY = process.env.E2B_API_KEY
const rnd = () => Math.random().toString(16).slice(2, 10)

test('Template build from base, then sandboxes of it', async () => {
  const ctx = fs.mkdtempSync(path.join(os.tmpdir(), 'e2b-js-tpl-'))
  fs.mkdirSync(path.join(ctx, 'site', 'sub'), { recursive: true })
  fs.writeFileSync(path.join(ctx, 'site', 'index.html'), 'hello from js\n')
  fs.writeFileSync(path.join(ctx, 'site', 'sub', 'x.txt'), 'x\n')
  const name = 'js-tpl-' + rnd()
  const logs = []
  const tpl = Template({ fileContextPath: ctx })
    .fromTemplate('base')
    .runCmd('mkdir -p /srv/www && chown user /srv/www && echo js-built-marker', { user: 'root' })
    .copy('site', '/srv/www/')
    .setEnvs({ GREETING: 'hi js' })
    .setWorkdir('/srv/www')
    .setStartCmd('python3 -m http.server 8000', waitForPort(8000))
  const info = await Template.build(tpl, name, { onBuildLogs: (e) => logs.push(e.message) })
  try {
    assert.ok(logs.join('\n').includes('js-built-marker'), logs.join('\n'))
    assert.equal(await Template.exists(name), true)
    assert.equal(await Template.exists(name + '-nope'), false)
    const sbx = await Sandbox.create(name)
    try {
      assert.equal(await sbx.files.read('/srv/www/sub/x.txt'), 'x\n')
      assert.equal((await sbx.commands.run('pwd')).stdout, '/srv/www\n')
      assert.equal((await sbx.commands.run('echo $GREETING')).stdout, 'hi js\n')
      // Served by the start command before create returned.
      assert.equal((await sbx.commands.run('curl -sf http://127.0.0.1:8000/index.html')).stdout, 'hello from js\n')
    } finally {
      await sbx.kill()
    }
    const tagged = await Template.assignTags(`${name}:default`, 'v1')
    assert.equal(tagged.buildId, info.buildId)
    assert.deepEqual((await Template.getTags(name)).map((t) => t.tag).sort(), ['default', 'v1'])
    await Template.removeTags(name, 'v1')
  } finally {
    await fetch(`${API}/templates/${info.templateId}`, { method: 'DELETE', headers: { 'X-API-Key': KEY } })
    fs.rmSync(ctx, { recursive: true, force: true })
  }
  assert.equal(await Template.exists(name), false)
})

test('a failing runCmd fails the build with its log', async () => {
  const name = 'js-fail-' + rnd()
  const logs = []
  await assert.rejects(
    Template.build(Template().fromTemplate('base').runCmd('echo js-about-to-fail; exit 4'), name, {
      onBuildLogs: (e) => logs.push(e.message),
    }),
    (err) => err instanceof BuildError && /step 1 failed/.test(err.message) && /exited with code 4/.test(err.message),
  )
  assert.ok(logs.join('\n').includes('js-about-to-fail'), logs.join('\n'))
  assert.equal(await Template.exists(name), false)
})
