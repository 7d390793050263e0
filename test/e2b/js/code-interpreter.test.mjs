// Acceptance test of OpenDsec's code interpreter (port 49999) with the
// unmodified npm `@e2b/code-interpreter` SDK (node:test). scripts/test-e2b.sh
// sets E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY and E2B_NPM_DIR.
import test from 'node:test'
import assert from 'node:assert/strict'
import { createRequire } from 'node:module'

const require = createRequire(process.env.E2B_NPM_DIR + '/')
const { Sandbox } = require('@e2b/code-interpreter')

test('code interpreter: state, errors, logs, contexts', async () => {
  const sbx = await Sandbox.create()
  try {
    await sbx.runCode('x = 1')
    const ex = await sbx.runCode('x + 1')
    assert.equal(ex.error, undefined)
    assert.equal(ex.text, '2')

    const err = await sbx.runCode("raise KeyError('k')")
    assert.equal(err.error.name, 'KeyError')
    assert.equal(err.error.value, "'k'")
    assert.match(err.error.traceback, /KeyError/)

    const out = []
    const logs = await sbx.runCode("print('from js')", { onStdout: (m) => out.push(m.line) })
    assert.deepEqual(logs.logs.stdout, ['from js\n'])
    assert.deepEqual(out, ['from js\n'])

    const ctx = await sbx.createCodeContext()
    assert.equal((await sbx.runCode("'x' in globals()", { context: ctx })).text, 'False')
    assert.ok((await sbx.listCodeContexts()).some((c) => c.id === ctx.id))
    await sbx.removeCodeContext(ctx)
    assert.equal((await sbx.runCode('x')).text, '1')
  } finally {
    await sbx.kill()
  }
})

test('code interpreter: rich results, contexts restart and list, errors', async () => {
  const sbx = await Sandbox.create()
  try {
    const rich = await sbx.runCode(
      "class R:\n    def _repr_html_(self): return '<b>b</b>'\n    def _repr_json_(self): return {'n': 1}\n    def __repr__(self): return 'R()'\nR()")
    const r = rich.results[0]
    assert.equal(r.isMainResult, true)
    assert.equal(r.text, 'R()')
    assert.equal(r.html, '<b>b</b>')
    assert.deepEqual(r.json, { n: 1 })
    assert.ok(r.formats().includes('html'))
    assert.equal((await sbx.runCode("{'k': [1, 2]}")).text, "{'k': [1, 2]}")

    const syn = await sbx.runCode('def f(:')
    assert.equal(syn.error.name, 'SyntaxError')
    const a = await sbx.runCode('1')
    const b = await sbx.runCode('2')
    assert.equal(b.executionCount, a.executionCount + 1)

    const ctx = await sbx.createCodeContext({ cwd: '/tmp' })
    assert.equal(ctx.cwd, '/tmp')
    await sbx.runCode('kept = 5', { context: ctx })
    assert.equal((await sbx.runCode('kept', { context: ctx })).text, '5')
    await sbx.restartCodeContext(ctx)
    assert.equal((await sbx.runCode('kept', { context: ctx })).error.name, 'NameError')
    assert.equal((await sbx.runCode('import os; os.getcwd()', { context: ctx })).text, "'/tmp'")
    await sbx.removeCodeContext(ctx.id)
    assert.ok(!(await sbx.listCodeContexts()).some((c) => c.id === ctx.id))
  } finally {
    await sbx.kill()
  }
})
