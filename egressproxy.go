package egressproxy

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/egressproxy/egressproxy/internal/clientlink"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/naming"
	"github.com/egressproxy/egressproxy/internal/obs"
)

// tracerName is the instrumentation scope of the client's spans and
// metrics.
const tracerName = "github.com/egressproxy/egressproxy"

// Options configure a Client. A nil *Options is valid.
type Options struct {
	// Logger receives one line per operation: V(1) for success and for
	// expected outcomes (NotFound, validation, the caller's cancellation, a
	// closed client), Info for Transient failures (retryable), Error for
	// the rest. Zero value: discard.
	Logger logr.Logger
	// TracerProvider creates one span per operation. Nil: no-op.
	TracerProvider trace.TracerProvider
	// MeterProvider records the duration of every operation and the
	// entry's facts from the last Check (docs/observability.md lists the
	// instruments). Nil: no-op.
	MeterProvider metric.MeterProvider
	// MetricAttributes are added to every measurement the client records:
	// a backend names its entry here (kvm2 adds egressproxy.entry). They
	// must not change while the client lives and should be few: each
	// distinct set is a series of its own. Empty string values are left
	// out and the others bounded like span attributes. Zero: none.
	MetricAttributes []attribute.KeyValue
}

// Client is the portable way to drive any backend. It validates
// input once, wraps every error exactly once with the operation and the
// instance (an *OpError, which keeps the provider's error class for
// errors.Is and Code), refuses calls after Close, and emits one span
// and one log line per operation. A Client is safe for concurrent use.
type Client struct {
	p      backend
	log    logr.Logger
	tracer trace.Tracer
	meters clientMeters

	mu       sync.RWMutex
	closed   bool
	closeMu  sync.Mutex // serialises Close
	closeErr error
	inflight sync.WaitGroup
}

func init() {
	clientlink.New = func(p, opts any) any {
		o, _ := opts.(*Options)
		return newClient(p.(backend), o)
	}
}

// backend is the method set of driver.Provider, the contract a backend
// implements (this package cannot name it: driver imports this package).
type backend interface {
	Create(ctx context.Context, spec Spec) (Instance, error)
	Get(ctx context.Context, ref Ref) (Instance, error)
	Delete(ctx context.Context, ref Ref) error
	List(ctx context.Context) ([]Instance, error)
	Check(ctx context.Context) (Health, error)
	Close() error
}

// imageBackend is the method set of driver.ImageManager.
type imageBackend interface {
	ListImages(ctx context.Context) ([]ImageInfo, error)
	VerifyImage(ctx context.Context, key string) (ImageInfo, error)
	EvictImage(ctx context.Context, key string) error
}

// newClient returns a Client over p (driver.NewClient). The Client owns p:
// Client.Close closes it.
func newClient(p backend, opts *Options) *Client {
	if opts == nil {
		opts = &Options{}
	}
	log := opts.Logger
	if log.GetSink() == nil {
		log = logr.Discard()
	}
	tp := opts.TracerProvider
	if tp == nil {
		tp = noop.NewTracerProvider()
	}
	c := &Client{p: p, log: log.WithName("egressproxy"), tracer: tp.Tracer(tracerName)}
	c.meters.init(opts.MeterProvider, opts.MetricAttributes)
	return c
}

// OpError is the error every Client method returns: the operation, the
// instance it concerned (empty for List and Check) or, for the image
// operations, the image key, and the backend's error. errors.Is, errors.As
// and Code see through it to the class.
//
// Its text is "egressproxy <op> <instance>: <backend's error>" ("egressproxy
// <op> <image key>: …" for the image operations): the client says the
// operation and the instance, so the layers below say only what failed. An
// instance name or image key that is not valid is left out: the validation
// error that comes with it quotes it, escaped and bounded. The whole text is
// valid UTF-8 of at most 1 KiB.
type OpError struct {
	// Op is "create", "get", "wait", "delete", "list", "check", "close",
	// "list-images", "verify-image" or "evict-image".
	Op       string
	Instance string // instance name, "" when not about one instance
	ImageKey string // image key of verify-image and evict-image, "" otherwise
	Err      error
}

func (e *OpError) Error() string {
	var b strings.Builder
	b.WriteString("egressproxy ")
	b.WriteString(e.Op)
	if e.Instance != "" && naming.ValidateName("Name", e.Instance) == nil {
		b.WriteByte(' ')
		b.WriteString(e.Instance)
	}
	if e.ImageKey != "" && naming.ValidateKey("ImageKey", e.ImageKey) == nil {
		b.WriteByte(' ')
		b.WriteString(e.ImageKey)
	}
	if e.Err != nil {
		b.WriteString(": ")
		b.WriteString(e.Err.Error())
	}
	return errs.ClipMessage(b.String())
}

func (e *OpError) Unwrap() error { return e.Err }

// begin registers an operation; it fails once the client is closed.
func (c *Client) begin() error {
	c.mu.RLock()
	defer c.mu.RUnlock()
	if c.closed {
		return ErrClosed // Permanent: it carries its class
	}
	c.inflight.Add(1)
	return nil
}

// wrap classes and wraps err once. Errors the provider returned without a
// class (Code is Unknown) are classed Transient (the conservative
// choice: a retry decides); WithCode then hides whatever class-less
// wrapping was inside, so the result has one class. Errors that carry a class
// (an *Error, a classed sentinel such as ErrNotFound, even
// bare) keep it, and context errors keep theirs.
func wrap(op, instance string, err error) error {
	return wrapTarget(op, target{instance: instance}, err)
}

// target is what an operation is about: an instance, an image key (image:
// an image operation; the key is "" for list-images), or neither.
type target struct {
	instance, imageKey string
	image              bool
}

func wrapTarget(op string, tg target, err error) error {
	if err == nil {
		return nil
	}
	var already *OpError
	if errors.As(err, &already) {
		return err
	}
	if Code(err) == Unknown {
		err = errs.WithCode(Transient, err)
	}
	return &OpError{Op: op, Instance: tg.instance, ImageKey: tg.imageKey, Err: err}
}

// spanNames are the stable span names of the operations (see
// docs/observability.md).
var spanNames = map[string]string{
	"create": "egressproxy.Create", "get": "egressproxy.Get", "delete": "egressproxy.Delete", "wait": "egressproxy.WaitRunning",
	"list": "egressproxy.List", "check": "egressproxy.Check", "close": "egressproxy.Close",
	"list-images": "egressproxy.ListImages", "verify-image": "egressproxy.VerifyImage", "evict-image": "egressproxy.EvictImage",
}

// keyImage is the span attribute of the image operations' image key.
const keyImage = attribute.Key("egressproxy.image")

func (c *Client) run(ctx context.Context, op, instance string, fn func(ctx context.Context) error) (opErr error) {
	return c.runTarget(ctx, op, target{instance: instance}, fn)
}

// runTarget is run for an operation about an instance or an image key
// (tg.imageKey: the span's egressproxy.image attribute and the log's image
// key, the error's ImageKey).
func (c *Client) runTarget(ctx context.Context, op string, tg target, fn func(ctx context.Context) error) (opErr error) {
	instance := tg.instance
	var extra []attribute.KeyValue
	if tg.imageKey != "" {
		extra = append(extra, keyImage.String(tg.imageKey))
	}
	ctx, span := obs.Start(ctx, c.tracer, spanNames[op], obs.Attrs{Instance: instance}, extra...)
	defer func() { obs.End(span, opErr) }()
	start := time.Now()
	err := c.begin()
	if err == nil {
		defer c.inflight.Done()
		if cerr := ctx.Err(); cerr != nil {
			err = errs.FromContext(cerr)
		} else {
			err = fn(ctx)
		}
	}
	err = wrapTarget(op, tg, err)
	elapsed := time.Since(start)
	c.meters.operation(ctx, op, elapsed, err)
	// The line names the instance, or for an image operation its image key
	// (key "image"; none for list-images).
	var who []any
	switch {
	case !tg.image:
		if instance != "" && naming.ValidateName("Name", instance) != nil {
			instance = errs.Quote(instance) // bounded and escaped: it is the caller's bad input
		}
		who = []any{"instance", instance}
	case tg.imageKey != "":
		key := tg.imageKey
		if naming.ValidateKey("ImageKey", key) != nil {
			key = errs.Quote(key) // bounded and escaped: it is the caller's bad input
		}
		who = []any{"image", key}
	}
	if err != nil {
		switch {
		case expected(ctx, err):
			c.log.V(1).Info("operation failed as expected", append(append([]any{"op", op}, who...), "code", Code(err).String(), "elapsed", elapsed, "err", err)...)
		case Code(err) == Transient:
			// A retry is the answer (the caller's backoff, a requeue):
			// visible at Info, but nothing for anyone to act on yet; the
			// caller that gives up decides whether it is an error.
			c.log.Info("operation failed, retryable", append(append([]any{"op", op}, who...), "code", Code(err).String(), "elapsed", elapsed, "err", err)...)
		default:
			c.log.Error(err, "operation failed", append(append([]any{"op", op}, who...), "code", Code(err).String(), "elapsed", elapsed)...)
		}
	} else {
		c.log.V(1).Info("operation done", append(append([]any{"op", op}, who...), "elapsed", elapsed)...)
	}
	return err
}

// expected reports whether err is an outcome a reconcile loop expects
// rather than a failure someone must act on: a missing instance, input that
// failed validation, the caller's own context ending, or a closed client.
// Those are logged at V(1), Transient failures at Info, everything else at
// Error.
func expected(ctx context.Context, err error) bool {
	var fe *FieldError
	switch {
	case Code(err) == NotFound, errors.As(err, &fe), errors.Is(err, ErrClosed):
		return true
	case ctx.Err() != nil && (Code(err) == Canceled || Code(err) == DeadlineExceeded):
		return true
	}
	return false
}

// Create validates spec, then creates the instance (idempotent on UID).
// A spec that fails validation returns a Permanent error naming the field
// and never reaches the backend.
func (c *Client) Create(ctx context.Context, spec Spec) (Instance, error) {
	var inst Instance
	err := c.run(ctx, "create", spec.Name, func(ctx context.Context) error {
		if err := spec.Validate(); err != nil {
			return err
		}
		var err error
		inst, err = c.p.Create(ctx, spec)
		return err
	})
	return inst, err
}

// Get reads the instance back from the backend. Missing: NotFound.
func (c *Client) Get(ctx context.Context, ref Ref) (Instance, error) {
	var inst Instance
	err := c.run(ctx, "get", ref.Name, func(ctx context.Context) error {
		if err := naming.ValidateRef(ref.Name, ref.UID); err != nil {
			return err
		}
		var err error
		inst, err = c.p.Get(ctx, ref)
		return err
	})
	return inst, err
}

// Delete removes the instance; deleting a missing instance succeeds.
func (c *Client) Delete(ctx context.Context, ref Ref) error {
	return c.run(ctx, "delete", ref.Name, func(ctx context.Context) error {
		if err := naming.ValidateRef(ref.Name, ref.UID); err != nil {
			return err
		}
		return c.p.Delete(ctx, ref)
	})
}

// List returns every instance the provider entry owns.
func (c *Client) List(ctx context.Context) ([]Instance, error) {
	var out []Instance
	err := c.run(ctx, "list", "", func(ctx context.Context) error {
		var err error
		out, err = c.p.List(ctx)
		return err
	})
	return out, err
}

// Check reports provider health. An unhealthy provider is a Health with a
// Reason, not an error.
func (c *Client) Check(ctx context.Context) (Health, error) {
	var h Health
	err := c.run(ctx, "check", "", func(ctx context.Context) error {
		var err error
		h, err = c.p.Check(ctx)
		return err
	})
	if err == nil {
		c.meters.checked(h)
	}
	return h, err
}

// imageManager returns the backend's image management, or an error
// wrapping ErrNotSupported (Permanent) when it has none.
func (c *Client) imageManager() (imageBackend, error) {
	if m, ok := c.p.(imageBackend); ok {
		return m, nil
	}
	return nil, errs.WithCode(Permanent, fmt.Errorf("%w: it has no image management", ErrNotSupported))
}

// validImageKey checks key with the catalogue rule, classed Permanent.
func validImageKey(key string) error {
	if err := naming.ValidateKey("ImageKey", key); err != nil {
		return errs.WithCode(Permanent, err)
	}
	return nil
}

// ListImages returns the base images of the provider's configured image
// keys, one per key, sorted by key (driver.ImageManager.ListImages). A
// provider without image management: an error wrapping
// ErrNotSupported (Permanent).
func (c *Client) ListImages(ctx context.Context) ([]ImageInfo, error) {
	var out []ImageInfo
	err := c.runTarget(ctx, "list-images", target{image: true}, func(ctx context.Context) error {
		m, err := c.imageManager()
		if err != nil {
			return err
		}
		out, err = m.ListImages(ctx)
		return err
	})
	return out, err
}

// VerifyImage reads the stored base of the image key back from the backend
// and returns it with Verified true when its bytes match the recorded
// digest (driver.ImageManager.VerifyImage): NotFound when the key has no
// base yet, Permanent for an invalid or unknown key or bytes that differ.
// A provider without image management: an error wrapping
// ErrNotSupported (Permanent).
func (c *Client) VerifyImage(ctx context.Context, key string) (ImageInfo, error) {
	var info ImageInfo
	err := c.runTarget(ctx, "verify-image", target{imageKey: key, image: true}, func(ctx context.Context) error {
		if err := validImageKey(key); err != nil {
			return err
		}
		m, err := c.imageManager()
		if err != nil {
			return err
		}
		info, err = m.VerifyImage(ctx, key)
		return err
	})
	return info, err
}

// EvictImage removes the stored base of the image key, so the next Create
// that needs it fetches it again (driver.ImageManager.EvictImage). It is
// refused (Permanent, naming the users) while any instance uses the base;
// evicting a key without a base succeeds. A provider without image
// management: an error wrapping ErrNotSupported (Permanent).
func (c *Client) EvictImage(ctx context.Context, key string) error {
	return c.runTarget(ctx, "evict-image", target{imageKey: key, image: true}, func(ctx context.Context) error {
		if err := validImageKey(key); err != nil {
			return err
		}
		m, err := c.imageManager()
		if err != nil {
			return err
		}
		return m.EvictImage(ctx, key)
	})
}

// As sets target, a non-nil pointer, to a backend-specific value the
// backend offers, and reports whether it did: the escape hatch to what only
// one backend has (memprovider's fault injection, for one). Each backend's
// package doc lists what it offers; a backend that offers nothing returns
// false.
func (c *Client) As(target any) bool {
	if a, ok := c.p.(interface{ As(any) bool }); ok {
		return a.As(target)
	}
	return false
}

// Close refuses new calls, closes the provider (which makes calls in
// flight return) and waits for those calls. It is idempotent; later calls return the first result.
func (c *Client) Close() error {
	c.closeMu.Lock()
	defer c.closeMu.Unlock()
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return c.closeErr
	}
	c.closed = true
	c.mu.Unlock()
	ctx, span := obs.Start(context.Background(), c.tracer, spanNames["close"], obs.Attrs{})
	defer func() { obs.End(span, c.closeErr) }()
	start := time.Now()
	// Close the provider first: it is what unblocks calls still in
	// flight; then wait for them to return.
	if err := c.p.Close(); err != nil {
		c.closeErr = wrap("close", "", err)
		c.log.Error(c.closeErr, "close failed")
	}
	c.inflight.Wait()
	c.meters.operation(ctx, "close", time.Since(start), c.closeErr)
	c.meters.close()
	return c.closeErr
}
