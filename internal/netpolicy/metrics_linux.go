package netpolicy

import "github.com/prometheus/client_golang/prometheus"

var (
	descDNSRefused = prometheus.NewDesc("opendsec_node_dns_refused_total",
		"DNS queries from sandboxes the node's DNS proxy refused, by reason (rate_limited: over the sandbox's dns_queries_per_second; private_answer: answers with private addresses removed for domain rules).",
		[]string{"reason"}, nil)
	descDNSEntries = prometheus.NewDesc("opendsec_node_dns_learned_entries",
		"(name, address) pairs the DNS proxy holds open for sandboxes' domain rules, over all sandboxes.", nil, nil)
	descDNSEvicted = prometheus.NewDesc("opendsec_node_dns_evicted_total",
		"(name, address) pairs dropped before their expiry because a sandbox reached max_dns_entries.", nil, nil)
	descNFTFlushes = prometheus.NewDesc("opendsec_node_dns_nft_flushes_total",
		"nftables transactions that carried DNS answers' set updates (concurrent answers share one).", nil, nil)
	descCTTeardown = prometheus.NewDesc("opendsec_node_teardown_conntrack_total",
		"Sandbox network teardowns by what they did about the node's conntrack entries from the sandbox (flushed: looked them up and deleted them, a walk of the kernel's whole conntrack hash; skipped: its egress counter saw no packet, so it had none).",
		[]string{"action"}, nil)
)

// Describe makes the Manager a prometheus.Collector; the node registers it.
func (m *Manager) Describe(ch chan<- *prometheus.Desc) {
	ch <- descDNSRefused
	ch <- descDNSEntries
	ch <- descDNSEvicted
	ch <- descNFTFlushes
	ch <- descCTTeardown
}

// Collect reports the DNS proxy's and teardown's counters.
func (m *Manager) Collect(ch chan<- prometheus.Metric) {
	ch <- prometheus.MustNewConstMetric(descDNSRefused, prometheus.CounterValue, float64(m.dnsRateLimited.Load()), "rate_limited")
	ch <- prometheus.MustNewConstMetric(descDNSRefused, prometheus.CounterValue, float64(m.dnsPrivate.Load()), "private_answer")
	ch <- prometheus.MustNewConstMetric(descDNSEntries, prometheus.GaugeValue, float64(m.learnedTotal.Load()))
	ch <- prometheus.MustNewConstMetric(descDNSEvicted, prometheus.CounterValue, float64(m.dnsEvicted.Load()))
	ch <- prometheus.MustNewConstMetric(descNFTFlushes, prometheus.CounterValue, float64(m.nftFlushes.Load()))
	ch <- prometheus.MustNewConstMetric(descCTTeardown, prometheus.CounterValue, float64(m.ctFlushes.Load()), "flushed")
	ch <- prometheus.MustNewConstMetric(descCTTeardown, prometheus.CounterValue, float64(m.ctSkipped.Load()), "skipped")
}
