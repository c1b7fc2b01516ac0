package memhost

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"

	"github.com/go-logr/logr"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/driver"
)

// ClientOptions configure the client of one entry of a memory host.
type ClientOptions struct {
	// Logger and MeterProvider of the client (its series carry
	// egressproxy.entry=Entry, as a memory entry's and a kvm2 entry's
	// do). Zero: discard, no-op.
	Logger        logr.Logger
	MeterProvider metric.MeterProvider
}

// NewClient returns the client of the memory host's entry at endpoint
// (CheckEndpoint's form): a driver.Provider that makes each call an HTTP
// request, wrapped by driver.NewClient. A call's context ends its
// request; an error of the host keeps its class, an unanswered request is
// Transient. Close releases its connections (the host's VMs stay).
func NewClient(endpoint, entry string, opts ClientOptions) (*egressproxy.Client, error) {
	if rule := CheckEndpoint(endpoint); rule != "" {
		return nil, &egressproxy.FieldError{Field: "endpoint", Value: endpoint, Rule: rule}
	}
	if entry == "" {
		return nil, &egressproxy.FieldError{Field: "entry", Rule: "is required"}
	}
	tr := &http.Transport{MaxIdleConns: 256, MaxIdleConnsPerHost: 256, DisableCompression: true}
	ctx, cancel := context.WithCancel(context.Background())
	p := &provider{base: endpoint + "/v1/" + entry + "/", tr: tr, hc: &http.Client{Transport: tr}, closed: ctx, close: cancel}
	return driver.NewClient(p, &egressproxy.Options{Logger: opts.Logger, MeterProvider: opts.MeterProvider,
		MetricAttributes: []attribute.KeyValue{attribute.String("egressproxy.entry", entry)}}), nil
}

// provider calls one entry of a memory host.
type provider struct {
	base string // endpoint/v1/entry/
	tr   *http.Transport
	hc   *http.Client
	// closed ends with Close: it ends the requests in flight too.
	closed context.Context
	close  context.CancelFunc
}

var _ driver.Provider = (*provider)(nil)

func (p *provider) Create(ctx context.Context, spec egressproxy.Spec) (egressproxy.Instance, error) {
	var inst egressproxy.Instance
	return inst, p.call(ctx, opCreate, spec, &inst)
}

func (p *provider) Get(ctx context.Context, ref egressproxy.Ref) (egressproxy.Instance, error) {
	var inst egressproxy.Instance
	return inst, p.call(ctx, opGet, ref, &inst)
}

func (p *provider) Delete(ctx context.Context, ref egressproxy.Ref) error {
	return p.call(ctx, opDelete, ref, nil)
}

func (p *provider) List(ctx context.Context) ([]egressproxy.Instance, error) {
	var insts []egressproxy.Instance
	return insts, p.call(ctx, opList, struct{}{}, &insts)
}

func (p *provider) Check(ctx context.Context) (egressproxy.Health, error) {
	var h egressproxy.Health
	return h, p.call(ctx, opCheck, struct{}{}, &h)
}

// Close ends the calls in flight and releases the connections; later
// calls are ErrClosed.
func (p *provider) Close() error {
	p.close()
	p.tr.CloseIdleConnections()
	return nil
}

func errClosed() error {
	return driver.Errorf(egressproxy.Permanent, "memory host: %w", egressproxy.ErrClosed)
}

// call POSTs arg to the operation and decodes the answer into res (nil:
// discard it).
func (p *provider) call(ctx context.Context, op string, arg, res any) (err error) {
	if p.closed.Err() != nil {
		return errClosed()
	}
	// The request ends with ctx or with Close, and a connection that
	// became idle after Close is not kept.
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(p.closed, cancel)()
	defer func() {
		if p.closed.Err() != nil {
			p.tr.CloseIdleConnections()
			if ctx.Err() == nil && err != nil {
				err = errClosed()
			}
		}
	}()
	body, err := json.Marshal(arg)
	if err != nil {
		return driver.Errorf(egressproxy.Permanent, "memory host %s: %w", op, err)
	}
	req, err := http.NewRequestWithContext(rctx, http.MethodPost, p.base+op, bytes.NewReader(body))
	if err != nil {
		return driver.Errorf(egressproxy.Permanent, "memory host %s: %w", op, err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := p.hc.Do(req)
	if err != nil {
		if ctx.Err() != nil {
			return driver.Errorf(egressproxy.Code(ctx.Err()), "memory host %s: %w", op, ctx.Err())
		}
		return driver.Errorf(egressproxy.Transient, "memory host %s: %w", op, err)
	}
	defer resp.Body.Close()
	dec := json.NewDecoder(io.LimitReader(resp.Body, maxBody))
	if resp.StatusCode != http.StatusOK {
		var eb errorBody
		if err := dec.Decode(&eb); err != nil {
			return driver.Errorf(egressproxy.Transient, "memory host %s: status %d without an error: %v", op, resp.StatusCode, err)
		}
		return remoteError(eb)
	}
	if res == nil {
		return nil
	}
	if err := dec.Decode(res); err != nil {
		if ctx.Err() != nil {
			return driver.Errorf(egressproxy.Code(ctx.Err()), "memory host %s: %w", op, ctx.Err())
		}
		return driver.Errorf(egressproxy.Transient, "memory host %s: reading the answer: %w", op, err)
	}
	return nil
}

// remoteError is the host's error with its class (and sentinel) again.
func remoteError(eb errorBody) error {
	var is error
	switch eb.Is {
	case "specConflict":
		is = egressproxy.ErrSpecConflict
	case "closed":
		is = egressproxy.ErrClosed
	}
	if is != nil {
		return driver.Errorf(eb.Code, "%s: %w", eb.Message, is)
	}
	return driver.Errorf(eb.Code, "%s", eb.Message)
}
