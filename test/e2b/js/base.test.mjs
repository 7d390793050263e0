// The default templates, network.maskRequestHost and lifecycle autoResume
// with the unmodified npm `e2b` and `@e2b/code-interpreter` SDKs
// (node:test); see smoke.test.mjs for the setup.
import test from 'node:test'
import assert from 'node:assert/strict'
import { createRequire } from 'node:module'

const require = createRequire(process.env.E2B_NPM_DIR + '/')
const { Sandbox } = require('e2b')
const CI = require('@e2b/code-interpreter')

const HEADERS_SERVER = `
import http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = ''.join(k + ': ' + v + chr(10) for k, v in self.headers.items()).encode()
        self.send_response(200)
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
http.server.HTTPServer(('', 8080), H).serve_forever()
`

async function get200(url, headers, ms = 30000) {
  const deadline = Date.now() + ms
  for (;;) {
    try {
      const r = await fetch(url, { headers })
      if (r.status === 200) return await r.text()
    } catch {}
    if (Date.now() > deadline) throw new Error(`no 200 from ${url} within ${ms} ms`)
    await new Promise((r) => setTimeout(r, 100))
  }
}

test('base has node, git, curl and python (node -v: what ComputeSDK\'s TTI loop runs, test/e2b/clients)', async () => {
  const sbx = await Sandbox.create()
  try {
    assert.match((await sbx.commands.run('node -v')).stdout, /^v18\./)
    assert.match((await sbx.commands.run('npm -v')).stdout, /^9\./)
    assert.match((await sbx.commands.run('git --version')).stdout, /^git version /)
    assert.match((await sbx.commands.run('curl --version')).stdout, /^curl /)
    assert.match((await sbx.commands.run('python --version')).stdout, /^Python 3\.11/)
  } finally {
    await sbx.kill()
  }
})

test('code-interpreter-v1 imports numpy, pandas, matplotlib, PIL and runs !echo', async () => {
  const sbx = await CI.Sandbox.create()
  try {
    let ex = await sbx.runCode('import numpy, pandas, matplotlib, PIL\nnumpy.array([1, 2]).sum()')
    assert.equal(ex.error, undefined)
    assert.equal(ex.text, '3')
    ex = await sbx.runCode('!echo hi')
    assert.equal(ex.error, undefined)
    assert.deepEqual(ex.logs.stdout, ['hi\n'])
  } finally {
    await sbx.kill()
  }
})

test('network.maskRequestHost rewrites Host of user-port requests', async () => {
  const sbx = await Sandbox.create({ network: { maskRequestHost: 'custom-host.example.com:${PORT}' } })
  try {
    await sbx.files.write('/home/user/h.py', HEADERS_SERVER)
    await sbx.commands.run('python /home/user/h.py', { background: true })
    const text = await get200(process.env.E2B_SANDBOX_URL + '/', {
      'E2b-Sandbox-Id': sbx.sandboxId, 'E2b-Sandbox-Port': '8080',
    })
    assert.match(text, /^Host: custom-host\.example\.com:8080$/m)
  } finally {
    await sbx.kill()
  }
})

test('autoResume false: traffic does not resume a paused sandbox; connect does', async () => {
  const sbx = await Sandbox.create({ lifecycle: { onTimeout: 'pause', autoResume: false } })
  try {
    assert.equal((await sbx.getInfo()).lifecycle?.autoResume, false)
    assert.equal(await sbx.pause(), true)
    await assert.rejects(sbx.commands.run('echo woke', { requestTimeoutMs: 10000 }))
    assert.equal((await sbx.getInfo()).state, 'paused')
    const same = await Sandbox.connect(sbx.sandboxId)
    assert.equal((await same.commands.run('echo up')).stdout, 'up\n')
  } finally {
    await sbx.kill()
  }
})
