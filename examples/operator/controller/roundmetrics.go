package controller

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
	ctrlmetrics "sigs.k8s.io/controller-runtime/pkg/metrics"
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
)

func init() {
	ctrlmetrics.Registry.MustRegister(healthRoundDuration, healthRoundProxies)
}

// observeRound records a health round of n proxies that started at t0.
func observeRound(t0 time.Time, n int) {
	healthRoundDuration.Observe(time.Since(t0).Seconds())
	healthRoundProxies.Set(float64(n))
}
