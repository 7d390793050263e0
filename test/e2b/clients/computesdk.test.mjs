// ComputeSDK's E2B provider (npm computesdk + @computesdk/e2b), unpatched,
// with only the E2B variables set: its benchmark's time-to-interactive
// loop (tti.mjs: create, identity probe, `node -v`, destroy) 10 times, all
// of which must succeed, each sandbox gone afterwards.
// scripts/test-e2b-clients.sh sets the environment.
import test from 'node:test'
import assert from 'node:assert/strict'
import { newCompute, newRun, ttiIteration, pct } from './tti.mjs'

const API = process.env.E2B_API_URL
const KEY = process.env.E2B_API_KEY

async function sandboxIds () {
  const r = await fetch(API + '/v2/sandboxes?state=running,paused', { headers: { 'X-API-Key': KEY } })
  assert.equal(r.status, 200)
  return (await r.json()).map((s) => s.sandboxID)
}

test('ComputeSDK: the TTI loop (create + node -v) succeeds 10/10 and destroys each sandbox', async () => {
  const compute = newCompute()
  const run = newRun()
  const before = await sandboxIds()
  const results = []
  for (let i = 0; i < 10; i++) {
    const r = await ttiIteration(compute, run)
    assert.match(r.node, /^v\d+\.\d+\.\d+$/)
    // destroy() swallows its errors: the gateway must have no such sandbox.
    assert.ok(!(await sandboxIds()).includes(r.sandboxId), `sandbox ${r.sandboxId} outlived destroy()`)
    results.push(r)
  }
  assert.equal(results.length, 10)
  assert.equal(new Set(results.map((r) => r.sandboxId)).size, 10, 'ten distinct sandboxes')
  assert.deepEqual(await sandboxIds(), before)
  const tti = results.map((r) => r.ttiMs)
  console.log(`# ComputeSDK TTI over 10: median ${pct(tti, 50).toFixed(1)} ms, p95 ${pct(tti, 95).toFixed(1)} ms; repeated identity signals per iteration: ${results.map((r) => r.repeatedSignals).join(',')}`)
})
