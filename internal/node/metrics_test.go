package node

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"

	"github.com/kernflux/opendsec/internal/netpolicy"
	"github.com/kernflux/opendsec/internal/sandboxid"
)

// gathered returns the metric family name from reg, failing if absent.
func gathered(t *testing.T, reg prometheus.Gatherer, name string) *dto.MetricFamily {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			return mf
		}
	}
	t.Fatalf("metric %s not gathered", name)
	return nil
}

func labelsMatch(m *dto.Metric, want map[string]string) bool {
	n := 0
	for _, lp := range m.GetLabel() {
		if v, ok := want[lp.GetName()]; ok {
			if v != lp.GetValue() {
				return false
			}
			n++
		}
	}
	return n == len(want)
}

func TestMetricsCountCreates(t *testing.T) {
	f := newFixture(t)
	n := f.open(t)
	reg := n.Registry()
	cold := n.metrics.creates.WithLabelValues(createPathCold, "ok")
	if v := promtest.ToFloat64(cold); v != 0 {
		t.Fatalf("creates before any create: %v", v)
	}

	f.create(t, n, specRecord{})
	if _, err := n.Create(t.Context(), CreateRequest{ID: sandboxid.New(f.cfg.ID), Spec: specRecord{Image: "missing"}}); err == nil {
		t.Fatal("create of a missing image succeeded")
	}

	if v := promtest.ToFloat64(cold); v != 1 {
		t.Errorf("opendsec_node_creates_total{path=cold,result=ok} = %v, want 1", v)
	}
	if v := promtest.ToFloat64(n.metrics.creates.WithLabelValues(createPathCold, "error")); v != 1 {
		t.Errorf("opendsec_node_creates_total{path=cold,result=error} = %v, want 1", v)
	}
	for _, m := range gathered(t, reg, "opendsec_node_create_duration_seconds").GetMetric() {
		if labelsMatch(m, map[string]string{"path": createPathCold}) {
			if c := m.GetHistogram().GetSampleCount(); c != 2 {
				t.Errorf("cold create histogram count = %d, want 2", c)
			}
			if s := m.GetHistogram().GetSampleSum(); s <= 0 {
				t.Errorf("cold create histogram sum = %v, want > 0", s)
			}
		}
	}
	running := -1.0
	for _, m := range gathered(t, reg, "opendsec_node_sandboxes").GetMetric() {
		if labelsMatch(m, map[string]string{"state": stateRunning}) {
			running = m.GetGauge().GetValue()
		}
	}
	if running != 1 {
		t.Errorf("opendsec_node_sandboxes{state=running} = %v, want 1", running)
	}
	if v := promtest.ToFloat64(gaugeFunc(t, reg, "opendsec_node_warm_pool_ready")); v != 0 {
		t.Errorf("warm pool ready with the pool off = %v, want 0", v)
	}

	// GET /metrics is served without a token, in the text format.
	rr := httptest.NewRecorder()
	n.Handler().ServeHTTP(rr, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	if rr.Code != http.StatusOK {
		t.Fatalf("GET /metrics: %d %s", rr.Code, rr.Body)
	}
	if body := rr.Body.String(); !strings.Contains(body, `opendsec_node_creates_total{path="cold",result="ok"} 1`) {
		t.Fatalf("GET /metrics lacks the create count:\n%s", body)
	}
}

// gaugeFunc wraps one gathered single-series family as a Collector for
// promtest.ToFloat64.
func gaugeFunc(t *testing.T, reg prometheus.Gatherer, name string) prometheus.Collector {
	t.Helper()
	mf := gathered(t, reg, name)
	if len(mf.GetMetric()) != 1 {
		t.Fatalf("%s has %d series, want 1", name, len(mf.GetMetric()))
	}
	v := mf.GetMetric()[0].GetGauge().GetValue()
	return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: "copy"}, func() float64 { return v })
}

// collectingNet is a Network that also reports metrics, as netpolicy's
// Manager does.
type collectingNet struct{ desc *prometheus.Desc }

func (c collectingNet) Validate(netpolicy.Rules) error { return nil }
func (c collectingNet) Setup(context.Context, string, netpolicy.Rules) (netpolicy.Network, error) {
	return netpolicy.Network{}, nil
}
func (c collectingNet) Planned(id string) netpolicy.Network                     { return netpolicy.Network{ID: id} }
func (c collectingNet) SetRules(context.Context, string, netpolicy.Rules) error { return nil }
func (c collectingNet) Teardown(context.Context, string) error                  { return nil }
func (c collectingNet) Recover(context.Context, func(string) bool) (netpolicy.RecoverReport, error) {
	return netpolicy.RecoverReport{}, nil
}
func (c collectingNet) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }
func (c collectingNet) Collect(ch chan<- prometheus.Metric) {
	ch <- prometheus.MustNewConstMetric(c.desc, prometheus.CounterValue, 7, "rate_limited")
}

// TestMetricsIncludeNetwork: the network policy's metrics (the DNS proxy's
// refusals) are on the node's registry.
func TestMetricsIncludeNetwork(t *testing.T) {
	f := newFakeFixture(t)
	f.cfg.Network = collectingNet{desc: prometheus.NewDesc("opendsec_node_dns_refused_total", "test", []string{"reason"}, nil)}
	n := f.open(t)
	mf := gathered(t, n.Registry(), "opendsec_node_dns_refused_total")
	if len(mf.GetMetric()) != 1 || mf.GetMetric()[0].GetCounter().GetValue() != 7 {
		t.Errorf("opendsec_node_dns_refused_total = %v, want 7", mf.GetMetric())
	}
}
