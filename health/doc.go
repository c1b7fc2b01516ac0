// Package health probes HTTP CONNECT proxies end to end and tracks their
// health across probe rounds.
//
// Probe sends one real "CONNECT target HTTP/1.1" through a proxy (with basic
// Proxy-Authorization when credentials are set, over TLS to an HTTPS proxy
// when ProxyTLS is set) and succeeds only on a 2xx answer and, when asked,
// a TLS handshake or an exchange through the tunnel (HTTPGet is one). It
// measures connect, first-byte and total latency; a failure is a
// *ProbeError whose Kind says what failed (refused, timeout, TLS, 407,
// other status, ...). With an EgressURL, a successful probe also fetches a
// "what is my address" URL through the proxy and reports the address its
// traffic leaves from (Result.EgressAddress). A probe never outlives its
// context or timeout.
//
// ProbeAll probes many proxies with a fixed number of workers. A Tracker
// decides per proxy, round by round (Tracker.Round): Rise consecutive
// successes make it healthy, Fall consecutive failures unhealthy, and a
// proxy whose address is unknown keeps its state for Grace before it is
// forgotten (OnForget is then called once). It keeps each proxy's egress
// address and reports a change as an event of its own (OnEgressChange), not
// as a health failure.
//
// Logs go to the logr.Logger, spans ("health.ProbeAll", "health.Round") to
// the trace.TracerProvider and metrics (each probe's duration by kind, each
// tracked proxy's state) to the metric.MeterProvider given in the options;
// a proxy's state series end when the Tracker forgets it. The
// package starts no background goroutine: every goroutine it starts ends
// before the call that started it returns. Scheduling rounds, choosing the
// CONNECT target, discovering proxies and acting on an unhealthy one are
// the caller's.
package health
