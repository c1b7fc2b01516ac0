// Package health probes HTTP CONNECT proxies end to end and tracks their
// health across probe rounds.
//
// # What it owns
//
//   - Probe: one real CONNECT through a proxy to a target. It opens TCP to
//     the proxy, sends "CONNECT target HTTP/1.1" (with basic
//     Proxy-Authorization when credentials are set), reads the response
//     head with a small pooled reader and succeeds only on a 2xx status.
//     Optionally it proves the tunnel with a TLS handshake or a
//     caller-supplied exchange through it. Latencies (connect, time to
//     first byte, total) are measured; failures are classified by Kind
//     (refused, timeout, DNS, 407, other proxy status, malformed answer,
//     tunnel failed, canceled, network, bad input). A probe never outlives
//     its context or timeout and always closes its connection.
//   - ProbeAll: many probes with a fixed number of worker goroutines (never
//     one goroutine per proxy) and a timeout per probe.
//   - Tracker: per-proxy state over rounds with rise/fall thresholds (N
//     consecutive successes to become healthy, M consecutive failures to
//     become unhealthy), a grace period before a proxy whose address
//     disappeared is forgotten (one empty address read does not pull a
//     healthy proxy out of rotation), an OnForget hook called exactly once
//     per forgotten proxy, and snapshots. It is safe for concurrent use
//     and takes an injectable clock.
//
// Logs go only to the logr.Logger the embedder passes; spans (one per
// ProbeAll and per Tracker.Round) only to the trace.TracerProvider it
// passes (no-op by default); docs/observability.md lists them.
//
// # What it does not own
//
// Scheduling rounds (when and how often to probe), retries and backoff,
// choosing the CONNECT target, deciding what to do with an unhealthy proxy
// (replace it, page someone), discovering proxies and their addresses
// (that is the provider's job: the embedder passes IDs and addresses),
// metrics back-ends (use OnForget to drop a forgotten proxy's series) and
// persistence of the tracker's state across restarts. The package starts no
// background goroutine: every goroutine it starts ends before the call that
// started it returns.
package health
