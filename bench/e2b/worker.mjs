// One E2B JS SDK iteration per "run" line on stdin: Sandbox.create(),
// commands.run("echo hi"), kill(); answers one JSON line of phase times in
// milliseconds. Driven by bench/e2b/driver.py, which interleaves it with
// OpenDsec's Python SDK. Needs E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY and
// E2B_NPM_DIR (where e2b is installed).
import { createRequire } from 'node:module'
import readline from 'node:readline'

const require = createRequire(process.env.E2B_NPM_DIR + '/')
const { Sandbox } = require('e2b')

async function once () {
  const t0 = performance.now()
  const sbx = await Sandbox.create({ metadata: { bench: 'e2b-js' } })
  const t1 = performance.now()
  try {
    const r = await sbx.commands.run('echo hi')
    if (r.stdout !== 'hi\n') throw new Error(`echo hi printed ${JSON.stringify(r.stdout)}`)
  } catch (e) {
    await sbx.kill()
    throw e
  }
  const t2 = performance.now()
  await sbx.kill()
  const t3 = performance.now()
  return { create: t1 - t0, run: t2 - t1, kill: t3 - t2, total: t3 - t0 }
}

const rl = readline.createInterface({ input: process.stdin })
for await (const line of rl) {
  if (line.trim() !== 'run') continue
  try {
    process.stdout.write(JSON.stringify(await once()) + '\n')
  } catch (e) {
    process.stdout.write(JSON.stringify({ error: String(e && e.stack || e) }) + '\n')
  }
}
