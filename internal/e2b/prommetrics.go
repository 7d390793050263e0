package e2b

import (
	"bufio"
	"net"
	"net/http"
	"strconv"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// routeProxy is the route label of sandbox traffic (envd and user ports,
// by header, host or signed file URL); REST requests carry their mux
// pattern, so no label holds a sandbox ID.
const routeProxy = "sandbox traffic"

// promMetrics are the gateway's Prometheus metrics, on a registry of its own
// so that several components (and tests) share one process without
// clashing.
type promMetrics struct {
	reg      *prometheus.Registry
	requests *prometheus.CounterVec // route, code
}

func newPromMetrics() *promMetrics {
	m := &promMetrics{
		reg: prometheus.NewRegistry(),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "opendsec_e2b_requests_total",
			Help: `Requests handled, by route (the REST API's mux pattern, or "sandbox traffic" for proxied envd and port traffic) and HTTP status code (101 for a port tunnel).`,
		}, []string{"route", "code"}),
	}
	m.reg.MustRegister(
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		m.requests,
	)
	return m
}

func (m *promMetrics) handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{})
}

// Registry returns the gateway's Prometheus registry.
func (g *Gateway) Registry() *prometheus.Registry { return g.prom.reg }

// statusWriter remembers the status code a handler sent. Flushes and
// other optional interfaces reach the wrapped writer through Unwrap
// (http.ResponseController); Hijack is wrapped to note port tunnels.
type statusWriter struct {
	http.ResponseWriter
	code     int
	hijacked bool
}

func (s *statusWriter) WriteHeader(code int) {
	if s.code == 0 && code >= 200 {
		s.code = code
	}
	s.ResponseWriter.WriteHeader(code)
}

func (s *statusWriter) Write(b []byte) (int, error) {
	if s.code == 0 {
		s.code = http.StatusOK
	}
	return s.ResponseWriter.Write(b)
}

func (s *statusWriter) Unwrap() http.ResponseWriter { return s.ResponseWriter }

func (s *statusWriter) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	c, brw, err := http.NewResponseController(s.ResponseWriter).Hijack()
	if err == nil {
		s.hijacked = true
	}
	return c, brw, err
}

// status is the code label of the response.
func (s *statusWriter) status() string {
	switch {
	case s.code != 0:
		return strconv.Itoa(s.code)
	case s.hijacked:
		return strconv.Itoa(http.StatusSwitchingProtocols)
	default:
		return strconv.Itoa(http.StatusOK)
	}
}
