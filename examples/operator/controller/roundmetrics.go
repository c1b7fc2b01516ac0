package controller

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
	ctrlmetrics "sigs.k8s.io/controller-runtime/pkg/metrics"

	"github.com/egressproxy/egressproxy/health"
)

// The operator's own series of its health rounds, in controller-runtime's
// registry (served on --metrics-bind-address beside the library's): how
// long one round of probes over every registered proxy takes, and how
// many proxies the last round probed. The scale bench (cmd/scale) reads
// them for the wall time of a round of all N proxies.
var (
	healthRoundDuration = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "egressproxy_operator_health_round_duration_seconds",
		Help:    "Wall time of one health round: every registered proxy probed once and the results recorded.",
		Buckets: prometheus.ExponentialBuckets(0.005, 2, 16), // 5ms … 164s
	})
	healthRoundProxies = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "egressproxy_operator_health_round_proxies",
		Help: "Proxies the last health round probed (registered ones, with or without an address).",
	})
	// healthProxies is what this replica's tracker has decided, by
	// state: a new leader's healthy count reaches the fleet's size once
	// it has probed every proxy itself (Rise probes each), which the
	// scale bench's failover waits for.
	healthProxies = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "egressproxy_operator_health_proxies",
		Help: "Registered proxies by this replica's health decision (state: healthy, unhealthy, unknown: not decided yet), as of the last probes.",
	}, []string{"state"})
)

func init() {
	ctrlmetrics.Registry.MustRegister(healthRoundDuration, healthRoundProxies, healthProxies)
}

// observeStates sets healthProxies to the counts by state (every state
// has a series, zero or not).
func observeStates(counts map[health.State]int) {
	for _, st := range []health.State{health.StateHealthy, health.StateUnhealthy, health.StateUnknown} {
		healthProxies.WithLabelValues(st.String()).Set(float64(counts[st]))
	}
}

// observeRound records a health round of n proxies that started at t0.
func observeRound(t0 time.Time, n int) {
	healthRoundDuration.Observe(time.Since(t0).Seconds())
	healthRoundProxies.Set(float64(n))
}
