// One ComputeSDK TTI iteration (test/e2b/clients/tti.mjs) per "run" line on
// stdin, answered with one JSON line ({ttiMs, sandboxId, node,
// repeatedSignals} or {error}). Driven by bench/e2btti (Go), which
// interleaves it with the same loop through OpenDsec's Go client. Needs the
// E2B variables and E2B_NPM_DIR (scripts/test-e2b-clients.sh's npm dir).
import readline from 'node:readline'
import { newCompute, newRun, ttiIteration } from '../../test/e2b/clients/tti.mjs'

const compute = newCompute()
const run = newRun()
for await (const line of readline.createInterface({ input: process.stdin })) {
  if (line.trim() !== 'run') continue
  try {
    process.stdout.write(JSON.stringify(await ttiIteration(compute, run)) + '\n')
  } catch (e) {
    process.stdout.write(JSON.stringify({ error: String((e && e.stack) || e) }) + '\n')
  }
}
