package watcher

import (
	"net/http"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// metrics are the watcher's Prometheus metrics, on a registry of its own so
// that several components (and tests) share one process without clashing.
type metrics struct {
	reg   *prometheus.Registry
	polls *prometheus.CounterVec // result
}

func newMetrics(w *Watcher) *metrics {
	m := &metrics{
		reg: prometheus.NewRegistry(),
		polls: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "opendsec_watcher_polls_total",
			Help: "Polls of a node that finished, by result (ok: the node answered, error: it did not or answered wrongly).",
		}, []string{"result"}),
	}
	m.polls.WithLabelValues("ok")
	m.polls.WithLabelValues("error")
	nodes := func(healthy bool) prometheus.GaugeFunc {
		label := "false"
		if healthy {
			label = "true"
		}
		return prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name:        "opendsec_watcher_nodes",
			Help:        "Configured nodes in the watcher's view, by health.",
			ConstLabels: prometheus.Labels{"healthy": label},
		}, func() float64 { return float64(w.countNodes(healthy)) })
	}
	m.reg.MustRegister(
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		m.polls, nodes(true), nodes(false),
	)
	return m
}

// pollDone records a finished poll of one node.
func (m *metrics) pollDone(err error) {
	res := "ok"
	if err != nil {
		res = "error"
	}
	m.polls.WithLabelValues(res).Inc()
}

// countNodes returns how many nodes of the view have the given health.
func (w *Watcher) countNodes(healthy bool) int {
	w.mu.RLock()
	defer w.mu.RUnlock()
	n := 0
	for _, st := range w.status {
		if st.GetHealthy() == healthy {
			n++
		}
	}
	return n
}

// Registry returns the watcher's Prometheus registry.
func (w *Watcher) Registry() *prometheus.Registry { return w.metrics.reg }

// MetricsHandler serves the watcher's metrics in the Prometheus text format;
// mount it at GET /metrics on the watcher's listener, without a token.
func (w *Watcher) MetricsHandler() http.Handler {
	return promhttp.HandlerFor(w.metrics.reg, promhttp.HandlerOpts{})
}
