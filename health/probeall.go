package health

import (
	"context"
	"crypto/tls"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/egressproxy/egressproxy/internal/obs"
)

// defaultWorkers is the number of probes in flight when
// ProbeAllOptions.Workers is zero.
const defaultWorkers = 64

// tracerName is the instrumentation scope of this package's spans.
const tracerName = "github.com/egressproxy/egressproxy/health"

// Proxy is one proxy to probe.
type Proxy struct {
	// ID identifies the proxy for the embedder (copied to Result.ID; the
	// Tracker's key).
	ID string
	// Address is the proxy's host:port. Tracker.Round treats an empty
	// Address as unknown this round: the proxy is not probed and keeps
	// its state. ProbeAll fails it as KindBadInput.
	Address string
	// Target is the CONNECT target (host:port). Empty: the round's
	// ProbeAllOptions.Target.
	Target string
	// Username and Password are this proxy's own basic-auth credentials,
	// sent instead of the round's Probe.Username and Probe.Password when
	// Username is set (proxies with credentials of their own probed in one
	// round). Empty Username: the round's credentials. Password never
	// reaches a log line, an error, a span or String.
	Username string
	Password string
	// ProxyTLS is this proxy's TLS configuration (its own CA, its own
	// ServerName), used instead of the round's Probe.ProxyTLS when set.
	// Nil: the round's.
	ProxyTLS *tls.Config
}

// ProbeAllOptions configures ProbeAll and Tracker.Round. A nil
// *ProbeAllOptions is valid and means the zero value of every field.
type ProbeAllOptions struct {
	// Workers is the maximum number of probes in flight: exactly
	// min(Workers, number of proxies) goroutines run, each one probe at a
	// time. Zero means 64; negative is treated as 1.
	Workers int
	// Target is the CONNECT target of proxies whose own Target is empty.
	// Zero: such proxies fail as KindBadInput in ProbeAll, and
	// Tracker.Round refuses the round with an error.
	Target string
	// Probe holds the options of every probe (timeout per probe,
	// credentials, tunnel proof, dialer). Zero: ProbeOptions defaults.
	Probe ProbeOptions
	// Logger receives a summary per round (V(1)) and each failed probe
	// (V(2)), on a logger named "health". Zero: logs are discarded
	// (Tracker.Round: the tracker's logger).
	Logger logr.Logger
	// TracerProvider provides the tracer for the span of the round
	// ("health.ProbeAll"). Zero: no-op (Tracker.Round: the tracker's).
	TracerProvider trace.TracerProvider
	// MeterProvider records each probe's duration by its kind
	// (egressproxy.health.probe.duration). Zero: nothing is recorded
	// (Tracker.Round: the tracker's).
	MeterProvider metric.MeterProvider
}

// ProbeAll probes every proxy with bounded concurrency and returns one
// Result per proxy, in the order of proxies. Each probe has its own
// timeout (opts.Probe.Timeout). When ctx ends, probes in flight end
// promptly and proxies not yet probed get a KindCanceled (or KindTimeout)
// result without any connection being made. ProbeAll returns only after
// every goroutine it started has ended.
func ProbeAll(ctx context.Context, proxies []Proxy, opts *ProbeAllOptions) []Result {
	var o ProbeAllOptions
	if opts != nil {
		o = *opts
	}
	log := logr.Discard()
	if o.Logger.GetSink() != nil {
		log = o.Logger.WithName("health")
	}
	tp := o.TracerProvider
	if tp == nil {
		tp = noop.NewTracerProvider()
	}
	return probeAll(ctx, proxies, &o, log, tp, newProbeMeter(o.MeterProvider))
}

// probeAll is ProbeAll with its logger (already named), tracer provider
// and probe instruments (nil: none) resolved.
func probeAll(ctx context.Context, proxies []Proxy, o *ProbeAllOptions, log logr.Logger, tp trace.TracerProvider, pm *probeMeter) []Result {
	workers := o.Workers
	if workers == 0 {
		workers = defaultWorkers
	}
	workers = min(max(workers, 1), len(proxies))
	ctx, span := tp.Tracer(tracerName).Start(ctx, "health.ProbeAll", trace.WithAttributes(
		attribute.Int("health.targets", len(proxies)),
		attribute.Int("health.workers", workers),
	))
	defer span.End()
	start := time.Now()

	results := make([]Result, len(proxies))
	var next atomic.Int64
	var failed atomic.Int64
	var wg sync.WaitGroup
	wg.Add(workers)
	for range workers {
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1) - 1)
				if i >= len(proxies) {
					return
				}
				r := probeOne(ctx, &proxies[i], o)
				pm.record(ctx, &r)
				if !r.OK {
					failed.Add(1)
					if l := log.V(2); l.Enabled() {
						l.Info("probe failed", "id", r.ID, "proxy", r.Proxy, "target", r.Target,
							"kind", r.Kind.String(), "status", r.StatusCode, "err", r.Err)
					}
				}
				results[i] = r
			}
		}()
	}
	wg.Wait()

	nFailed := int(failed.Load())
	span.SetAttributes(
		attribute.Int("health.ok", len(proxies)-nFailed),
		attribute.Int("health.failed", nFailed),
	)
	if err := ctx.Err(); err != nil {
		obs.Fail(span, err) // error.type Canceled or DeadlineExceeded
	}
	log.V(1).Info("probe round", "targets", len(proxies), "workers", workers,
		"ok", len(proxies)-nFailed, "failed", nFailed, "elapsed", time.Since(start))
	return results
}

// probeOne probes p with the round's options, its own target and
// credentials winning; once ctx has ended it fails p without a connection.
func probeOne(ctx context.Context, p *Proxy, o *ProbeAllOptions) Result {
	target := p.Target
	if target == "" {
		target = o.Target
	}
	var r Result
	if err := ctx.Err(); err != nil {
		r = Result{Proxy: p.Address, Target: target, Start: time.Now()}
		r = r.fail(classify(ctx, err), "dial", context.Cause(ctx))
	} else {
		po := &o.Probe
		if p.Username != "" || p.ProxyTLS != nil {
			own := o.Probe
			if p.Username != "" {
				own.Username, own.Password = p.Username, p.Password
			}
			if p.ProxyTLS != nil {
				own.ProxyTLS = p.ProxyTLS
			}
			po = &own
		}
		r = Probe(ctx, p.Address, target, po)
	}
	r.ID = p.ID
	return r
}
