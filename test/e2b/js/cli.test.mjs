// The unmodified e2b CLI (npm @e2b/cli, pinned in scripts/test-e2b.sh)
// against OpenDsec's E2B gateway with only E2B_API_KEY and E2B_API_URL set:
// `e2b template list` (GET /templates) shows a template built here, and
// `e2b sandbox logs` (GET /sandboxes/{id}/logs, whose lines the CLI parses
// as JSON) shows a command run in a sandbox.
import test from 'node:test'
import assert from 'node:assert/strict'
import { execFile } from 'node:child_process'
import { createRequire } from 'node:module'
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { promisify } from 'node:util'

const require = createRequire(process.env.E2B_NPM_DIR + '/')
const { Sandbox, Template } = require('e2b')

const API = process.env.E2B_API_URL.replace(/\/$/, '')
const KEY = process.env.E2B_API_KEY
const CLI = path.join(process.env.E2B_NPM_DIR, 'node_modules', '.bin', 'e2b')
const rnd = () => Math.random().toString(16).slice(2, 10)

// cli runs the e2b CLI with a home of its own (no ~/.e2b login of the
// machine's user) and returns its stdout.
async function cli(...args) {
  const home = fs.mkdtempSync(path.join(os.tmpdir(), 'e2b-cli-home-'))
  try {
    const { stdout } = await promisify(execFile)(CLI, args, {
      env: { PATH: process.env.PATH, HOME: home, E2B_API_KEY: KEY, E2B_API_URL: API, E2B_SANDBOX_URL: process.env.E2B_SANDBOX_URL, E2B_DOMAIN: process.env.E2B_DOMAIN, NO_COLOR: '1' },
      timeout: 60_000,
    })
    return stdout
  } finally {
    fs.rmSync(home, { recursive: true, force: true })
  }
}

test('e2b CLI: template list and sandbox logs', async () => {
  const name = 'js-cli-' + rnd()
  const info = await Template.build(Template().fromTemplate('base').runCmd('echo cli-build-marker'), name)
  try {
    const list = JSON.parse(await cli('template', 'list', '--format', 'json'))
    const mine = list.find((t) => t.templateID === info.templateId)
    assert.ok(mine, `template list lacks ${info.templateId}: ${JSON.stringify(list)}`)
    assert.deepEqual(mine.aliases, [name])
    assert.equal(mine.public, false)

    const sbx = await Sandbox.create(name)
    try {
      await sbx.commands.run('echo cli-logs-marker')
      const out = await cli('sandbox', 'logs', sbx.sandboxId, '--format', 'json')
      const entries = out.split('\n').filter((l) => l.startsWith('{')).map((l) => JSON.parse(l))
      assert.ok(entries.some((e) => /sandbox started from template/.test(e.message)), out)
      assert.ok(entries.some((e) => e.message.includes('cli-logs-marker') && e.message.endsWith('ended with exit code 0') && e.exitCode === '0'), out)
    } finally {
      await sbx.kill()
    }
  } finally {
    await fetch(`${API}/templates/${info.templateId}`, { method: 'DELETE', headers: { 'X-API-Key': KEY } })
  }
})
