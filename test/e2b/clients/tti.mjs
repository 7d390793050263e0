// ComputeSDK's time-to-interactive (TTI) iteration, as its benchmark
// (computesdk/benchmarks, src/sandbox/benchmark.ts) defines it, for
// computesdk.test.mjs and bench/e2b-tti.sh: the clock runs from
// `compute.sandbox.create()` through an identity probe (a sandbox must not
// carry the marker an earlier one wrote into /tmp and /var/tmp; its
// namespaces, cgroup, boot id and PID 1 are noted, three of them repeated
// is a warning, as there by default) to `node -v` exiting 0; then the
// sandbox is destroyed, outside the clock. Needs the E2B variables and the
// clients' npm dir (E2B_NPM_DIR).
import { createRequire } from 'node:module'
import { randomUUID } from 'node:crypto'

const require = createRequire(process.env.E2B_NPM_DIR + '/')
const { e2b } = require('@computesdk/e2b')

// ComputeSDK's E2B provider as its benchmark makes it: the API key only
// (the e2b SDK underneath reads E2B_API_URL / E2B_DOMAIN like any E2B
// program).
export const newCompute = () => e2b({ apiKey: process.env.E2B_API_KEY })

const MARKERS = ['/tmp/.bench_ephemeral_check', '/var/tmp/.bench_ephemeral_check']
const SIGNALS = ['ns_mnt', 'ns_pid', 'ns_uts', 'cgroup_hash', 'boot_id', 'pid1']

function probe (token) {
  return [
    `found=; for p in ${MARKERS.join(' ')}; do [ -f "$p" ] && found=$p && break; done`,
    'echo "marker_path=$found"',
    'echo "ns_mnt=$(readlink /proc/self/ns/mnt)"',
    'echo "ns_pid=$(readlink /proc/self/ns/pid)"',
    'echo "ns_uts=$(readlink /proc/self/ns/uts)"',
    'echo "cgroup_hash=$(sha256sum </proc/self/cgroup | cut -d" " -f1)"',
    'echo "boot_id=$(cat /proc/sys/kernel/random/boot_id)"',
    'echo "pid1=$(tr -d \'\\0\' </proc/1/cmdline)"',
    ...MARKERS.map((m) => `printf %s '${token}' >${m}`),
  ].join('; ')
}

// A run's memory of the signals it saw.
export function newRun () {
  return { nonce: randomUUID(), seen: new Map() }
}

// One iteration: {ttiMs, sandboxId, node, repeatedSignals}; throws on any
// failure (after destroying what it made).
export async function ttiIteration (compute, run) {
  let sandbox = null
  try {
    const start = performance.now()
    sandbox = await compute.sandbox.create()
    const id = await sandbox.runCommand(probe(`${run.nonce}:${Math.random().toString(36).slice(2)}`))
    if (id.exitCode !== 0) throw new Error(`identity probe exited ${id.exitCode}: ${id.stderr}`)
    const seen = Object.fromEntries(id.stdout.split('\n').filter((l) => l.includes('=')).map((l) => [l.slice(0, l.indexOf('=')), l.slice(l.indexOf('=') + 1)]))
    if (seen.marker_path) throw new Error(`sandbox reuse: marker at ${seen.marker_path}`)
    let repeated = 0
    for (const k of SIGNALS) {
      if (!seen[k]) continue
      if (run.seen.get(k)?.has(seen[k])) repeated++
      run.seen.set(k, (run.seen.get(k) ?? new Set()).add(seen[k]))
    }
    const r = await sandbox.runCommand('node -v')
    if (r.exitCode !== 0) throw new Error(`node -v exited ${r.exitCode}: ${r.stderr}`)
    const ttiMs = performance.now() - start
    return { ttiMs, sandboxId: sandbox.sandboxId, node: r.stdout.trim(), repeatedSignals: repeated }
  } finally {
    if (sandbox) await sandbox.destroy()
  }
}

// Nearest-rank percentile.
export function pct (xs, p) {
  const s = [...xs].sort((a, b) => a - b)
  return s[Math.max(0, Math.ceil((p / 100) * s.length) - 1)]
}
