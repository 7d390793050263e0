package node

import (
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Create paths, the "path" label of the create metrics.
const (
	createPathWarm = "warm"
	createPathCold = "cold"
)

// metrics are the node's Prometheus metrics, on a registry of its own so
// that several components (and tests) share one process without clashing.
// Labels never carry sandbox IDs or user labels.
type metrics struct {
	reg *prometheus.Registry

	creates        *prometheus.CounterVec   // path, result
	createDuration *prometheus.HistogramVec // path
	prestarts      *prometheus.CounterVec   // result
	agentFailures  prometheus.Counter
	deaths         prometheus.Counter
	autoResumes    prometheus.Counter
	forks          *prometheus.CounterVec // result
	forkDuration   prometheus.Histogram
}

func newMetrics(n *Node) *metrics {
	m := &metrics{
		reg: prometheus.NewRegistry(),
		creates: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "opendsec_node_creates_total",
			Help: "Sandbox creates that returned, by path (warm: from the warm pool, cold: from scratch) and result (ok, error).",
		}, []string{"path", "result"}),
		createDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "opendsec_node_create_duration_seconds",
			Help: "Time from a sandbox create's start on the node to its return, by path.",
			// 1 ms .. ~2 s.
			Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .15, .2, .3, .5, .75, 1, 1.5, 2},
		}, []string{"path"}),
		prestarts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "opendsec_node_warm_pool_prestarts_total",
			Help: "Warm-pool prestarts that finished, by result (ok, error).",
		}, []string{"result"}),
		deaths: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "opendsec_node_sandbox_deaths_total",
			Help: "Sandboxes whose init ended without a stop (crash, kill from outside, out of memory).",
		}),
		autoResumes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "opendsec_node_auto_resumes_total",
			Help: "Paused sandboxes resumed because a call (exec, files, port traffic) came in for them.",
		}),
		agentFailures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "opendsec_node_agent_check_failures_total",
			Help: "New sandboxes stopped because their agent did not answer in time.",
		}),
		forks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "opendsec_node_forks_total",
			Help: "Sandbox forks that returned (one per call, however many sandboxes it made), by result (ok, error).",
		}, []string{"result"}),
		forkDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "opendsec_node_fork_duration_seconds",
			Help: "Time from a fork's start on the node to its return (every fork of the call running).",
			// 1 ms .. ~10 s.
			Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .15, .2, .3, .5, .75, 1, 1.5, 2, 3, 5, 10},
		}),
	}
	m.forks.WithLabelValues("ok")
	m.forks.WithLabelValues("error")
	for _, path := range []string{createPathWarm, createPathCold} {
		m.createDuration.WithLabelValues(path)
		for _, res := range []string{"ok", "error"} {
			m.creates.WithLabelValues(path, res)
		}
	}
	m.prestarts.WithLabelValues("ok")
	m.prestarts.WithLabelValues("error")
	m.reg.MustRegister(
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		m.creates, m.createDuration, m.prestarts, m.agentFailures, m.deaths, m.autoResumes, m.forks, m.forkDuration,
		&sandboxCollector{n: n, desc: prometheus.NewDesc("opendsec_node_sandboxes",
			"Sandboxes on the node, by state.", []string{"state"}, nil)},
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "opendsec_node_warm_pool_ready",
			Help: "Prestarted warm-pool sandboxes ready to be taken (0 when the pool is off).",
		}, func() float64 { return float64(n.pool.readyCount()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "opendsec_node_teardowns_pending",
			Help: "Stopped sandboxes whose teardown (mounts, loop device, netns, cgroups, files) still runs in the background.",
		}, func() float64 {
			n.mu.Lock()
			defer n.mu.Unlock()
			return float64(n.tearing)
		}),
	)
	// The network policy (internal/netpolicy's Manager) reports its DNS
	// proxy's counters: refused queries, remembered addresses.
	if c, ok := n.cfg.Network.(prometheus.Collector); ok {
		m.reg.MustRegister(c)
	}
	return m
}

// createDone records a create that returned after starting at start.
func (m *metrics) createDone(path string, start time.Time, err error) {
	res := "ok"
	if err != nil {
		res = "error"
	}
	m.creates.WithLabelValues(path, res).Inc()
	m.createDuration.WithLabelValues(path).Observe(time.Since(start).Seconds())
}

// forkDone records a fork that returned after starting at start.
func (m *metrics) forkDone(start time.Time, err error) {
	res := "ok"
	if err != nil {
		res = "error"
	}
	m.forks.WithLabelValues(res).Inc()
	m.forkDuration.Observe(time.Since(start).Seconds())
}

// prestartDone records a finished warm-pool prestart.
func (m *metrics) prestartDone(err error) {
	res := "ok"
	if err != nil {
		res = "error"
	}
	m.prestarts.WithLabelValues(res).Inc()
}

// sandboxCollector reports opendsec_node_sandboxes from the node's
// sandboxes at scrape time.
type sandboxCollector struct {
	n    *Node
	desc *prometheus.Desc
}

func (c *sandboxCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c *sandboxCollector) Collect(ch chan<- prometheus.Metric) {
	counts := map[string]int{stateRunning: 0, statePaused: 0, stateCreating: 0, stateStopping: 0}
	c.n.mu.Lock()
	for _, sb := range c.n.sandboxes {
		counts[sb.rec.State]++
	}
	c.n.mu.Unlock()
	for state, v := range counts {
		ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(v), state)
	}
}

// readyCount returns how many prestarted sandboxes are ready; 0 for a nil
// (off) pool.
func (p *pool) readyCount() int {
	if p == nil {
		return 0
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	total := 0
	for _, s := range p.shapes {
		total += len(s.ready)
	}
	return total
}

// Registry returns the node's Prometheus registry.
func (n *Node) Registry() *prometheus.Registry { return n.metrics.reg }

// MetricsHandler serves the node's metrics in the Prometheus text format.
func (n *Node) MetricsHandler() http.Handler {
	return promhttp.HandlerFor(n.metrics.reg, promhttp.HandlerOpts{})
}
