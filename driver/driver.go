package driver

import (
	"context"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/internal/clientlink"
	"github.com/egressproxy/egressproxy/internal/errs"
)

// Provider manages proxy instances on one backend entry (for kvm2: one
// hypervisor host and storage pool). All methods are safe for concurrent use
// and honour ctx: when ctx ends, a call returns promptly with an error for
// which Code is Canceled or DeadlineExceeded.
//
// The client passes Create only specs that pass Spec.Validate, and Get and
// Delete only valid refs. A provider validates again what it relies on and
// returns a Permanent error naming the field, before it touches a backend.
// Every error a provider returns has a class (Errorf); the client classes an
// unclassed error Transient.
type Provider interface {
	// Create makes the instance described by spec and starts it. It is
	// idempotent on spec.UID: if an instance with this name and UID
	// exists and was created from the same spec (same Spec.Digest), it is
	// returned unchanged, never duplicated; if it was created from another
	// spec, Create fails with egressproxy.ErrSpecConflict (Permanent) and changes
	// nothing. An object with the same name but another UID is a
	// Permanent error (name taken).
	//
	// Create converges: after any interruption (context ended, Close,
	// link lost, process killed) at any point of a Create, calling Create
	// again with the same spec completes the same instance (all of its
	// backend objects, started) or returns a clear error; concurrent
	// Creates of one spec (even from two processes) all return that one
	// instance, or a Transient error that a retry resolves. A partial
	// failure leaves nothing that a later Create or Delete cannot clean
	// up. Errors: Permanent (bad spec, name taken, spec conflict, image
	// digest mismatch, backend refuses the definition), Transient (backend
	// unreachable or busy, a race with another call a retry resolves),
	// context codes.
	Create(ctx context.Context, spec egressproxy.Spec) (egressproxy.Instance, error)
	// Get reads the instance back from the backend every time (UID,
	// creation time, state, address, spec digest). Errors: NotFound (missing, or the
	// name belongs to another UID or owner), Transient (backend
	// unreachable, or every address source failed), context codes.
	Get(ctx context.Context, ref egressproxy.Ref) (egressproxy.Instance, error)
	// Delete removes the instance and its own volumes; never a shared base
	// image. Deleting a missing instance succeeds (nil). Errors:
	// Transient, Permanent (backend refuses), context codes.
	Delete(ctx context.Context, ref egressproxy.Ref) error
	// List returns every instance this provider entry owns, and only
	// those, with Name, UID, CreatedAt and State (addresses may be left
	// empty). Errors: Transient, context codes.
	List(ctx context.Context) ([]egressproxy.Instance, error)
	// Check reports provider health without creating anything. An
	// unhealthy backend is reported in egressproxy.Health with a Reason, not as an
	// error; the error is for the call itself (context ended, provider
	// closed).
	Check(ctx context.Context) (egressproxy.Health, error)
	// Close releases every connection and goroutine. It does not delete
	// instances. Calls after Close return an error wrapping egressproxy.ErrClosed,
	// classed Permanent. Close is idempotent.
	Close() error
}

// ImageManager is an optional interface a Provider may implement (in the
// style of database/sql/driver's optional interfaces) to let its user see
// and manage the base images it keeps for instances: list them, prove the
// stored bytes, and evict one that is no longer wanted. egressproxy.Client
// exposes it as Client.ListImages, Client.VerifyImage and Client.EvictImage,
// and returns an error wrapping egressproxy.ErrNotSupported (Permanent) for a provider
// that does not implement it. drivertest runs its conformance cases for
// every provider that does.
//
// A provider may also have a method As(target any) bool: Client.As calls it
// so the provider can offer a value of its own (see Client.As).
type ImageManager interface {
	// ListImages returns the base images of the provider's configured image
	// keys, one per key, sorted by Key; an image key whose base is not
	// present has Present false. Errors: Transient (backend unreachable),
	// context codes.
	ListImages(ctx context.Context) ([]egressproxy.ImageInfo, error)
	// VerifyImage reads the stored base of the image key back from the
	// backend, hashes it, and returns it with Verified true when the bytes
	// match the recorded digest. Errors: NotFound (the key is configured
	// but has no base yet), Permanent (unknown key, or stored bytes differ
	// from the recorded digest: nothing is deleted, instances may use it),
	// Transient, context codes.
	VerifyImage(ctx context.Context, key string) (egressproxy.ImageInfo, error)
	// EvictImage removes the stored base of the image key, so the next
	// Create that needs it fetches it again. It refuses, Permanent, naming
	// the users, while any instance (running or not) uses the base.
	// Evicting a key that has no base is not an error. Errors: Permanent
	// (unknown key, in use), Transient, context codes.
	EvictImage(ctx context.Context, key string) error
}

// NewClient returns the portable client over p, the value a backend's Open
// or New returns to its users. The client owns p: Client.Close closes it.
// A nil opts is valid.
func NewClient(p Provider, opts *egressproxy.Options) *egressproxy.Client {
	return clientlink.New(p, opts).(*egressproxy.Client)
}

// Errorf formats an error as fmt.Errorf does (%w allowed) and gives it the
// class code, hiding any class inside it: the one way a backend classes its
// errors. A code that is not a class (OK, Unknown) gives an unclassed error,
// which the client classes Transient.
func Errorf(code egressproxy.ErrorCode, format string, args ...any) error {
	return errs.Errorf(code, format, args...)
}
