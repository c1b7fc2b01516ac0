package health

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/egressproxy/egressproxy/internal/obs"
)

// DefaultWorkers is the number of concurrent probes ProbeAll runs when
// ProbeAllOptions.Workers is zero.
const DefaultWorkers = 64

// tracerName is the instrumentation scope of this package's spans.
const tracerName = "github.com/egressproxy/egressproxy/health"

// Target is one proxy to probe.
type Target struct {
	// ID identifies the proxy for the embedder (copied to Result.ID).
	ID string `json:"id"`
	// ProxyAddr is the proxy's host:port.
	ProxyAddr string `json:"proxyAddr"`
	// TargetAddr is the CONNECT target (host:port). Empty: the round's
	// ProbeAllOptions.TargetAddr.
	TargetAddr string `json:"targetAddr,omitempty"`
	// Username and Password are this proxy's own basic-auth credentials,
	// sent instead of the round's Probe.Username and Probe.Password when
	// Username is set (proxies with credentials of their own probed in one
	// round). Empty Username: the round's credentials. Password never
	// reaches a log line, error or span (String leaves it out).
	Username string `json:"username,omitempty"`
	Password string `json:"-"`
}

// String returns the target as its JSON form, without the password.
func (t Target) String() string { return optionsText(t) }

// GoString is String for %#v.
func (t Target) GoString() string { return "health.Target" + t.String() }

// ProbeAllOptions configures ProbeAll. A nil *ProbeAllOptions is valid and
// means the zero value of every field.
type ProbeAllOptions struct {
	// Workers is the maximum number of probes in flight. ProbeAll starts
	// exactly min(Workers, len(targets)) goroutines, each running one probe
	// at a time. Zero means DefaultWorkers; negative is treated as 1.
	Workers int `json:"workers,omitempty"`
	// TargetAddr is the CONNECT target for targets with an empty
	// TargetAddr. Zero: such targets fail as KindBadInput.
	TargetAddr string `json:"targetAddr,omitempty"`
	// Probe holds the options of every probe (timeout per probe,
	// credentials, tunnel proof, dialer). Zero: ProbeOptions defaults.
	Probe ProbeOptions `json:"probe"`
	// Logger receives a summary per round (V(1)) and each failed probe
	// (V(2)). Zero: logs are discarded.
	Logger logr.Logger `json:"-"`
	// TracerProvider provides the tracer for the span of the round
	// ("health.ProbeAll"). Zero: no-op.
	TracerProvider trace.TracerProvider `json:"-"`
}

// ProbeAll probes every target with bounded concurrency and returns one
// Result per target, in the order of targets. Each probe has its own
// timeout (opts.Probe.Timeout). When ctx ends, probes in flight end
// promptly and targets not yet started get a KindCanceled (or
// KindTimeout) result without any connection being made. ProbeAll returns
// only after every goroutine it started has ended.
func ProbeAll(ctx context.Context, targets []Target, opts *ProbeAllOptions) []Result {
	var o ProbeAllOptions
	if opts != nil {
		o = *opts
	}
	log := o.Logger
	if log.GetSink() == nil {
		log = logr.Discard()
	}
	tp := o.TracerProvider
	if tp == nil {
		tp = noop.NewTracerProvider()
	}
	workers := o.Workers
	if workers == 0 {
		workers = DefaultWorkers
	}
	if workers < 1 {
		workers = 1
	}
	if workers > len(targets) {
		workers = len(targets)
	}
	ctx, span := tp.Tracer(tracerName).Start(ctx, "health.ProbeAll", trace.WithAttributes(
		attribute.Int("health.targets", len(targets)),
		attribute.Int("health.workers", workers),
	))
	defer span.End()
	start := time.Now()

	results := make([]Result, len(targets))
	var next atomic.Int64
	var failed atomic.Int64
	var wg sync.WaitGroup
	wg.Add(workers)
	for w := 0; w < workers; w++ {
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1) - 1)
				if i >= len(targets) {
					return
				}
				t := &targets[i]
				dst := t.TargetAddr
				if dst == "" {
					dst = o.TargetAddr
				}
				var r Result
				if err := ctx.Err(); err != nil {
					r = Result{Proxy: t.ProxyAddr, Target: dst, Start: time.Now()}
					r = r.fail(classify(ctx, err), "dial", context.Cause(ctx))
				} else {
					po := &o.Probe
					if t.Username != "" {
						own := o.Probe
						own.Username, own.Password = t.Username, t.Password
						po = &own
					}
					r = Probe(ctx, t.ProxyAddr, dst, po)
				}
				r.ID = t.ID
				if !r.OK {
					failed.Add(1)
					if l := log.V(2); l.Enabled() {
						l.Info("probe failed", "id", t.ID, "proxy", t.ProxyAddr, "target", dst,
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
		attribute.Int("health.ok", len(targets)-nFailed),
		attribute.Int("health.failed", nFailed),
	)
	if err := ctx.Err(); err != nil {
		obs.Fail(span, err) // error.type Canceled or DeadlineExceeded
	}
	log.V(1).Info("probe round", "targets", len(targets), "workers", workers,
		"ok", len(targets)-nFailed, "failed", nFailed, "duration", time.Since(start))
	return results
}
