// Package provider defines what a backend that runs egress proxies must do:
// the Provider interface, the Spec an instance is created from, the Instance
// read back from the backend, provider Health, and the fixed set of error
// classes (ErrTransient, ErrPermanent, ErrNotFound, plus the caller's context
// errors) with Code to read them.
//
// The package owns the contract and the input rules (Spec.Validate,
// ValidateName), and the spec digest (Spec.Digest) with which providers record
// the spec an instance was created from (Instance.SpecDigest) and report a
// Create of an existing UID with another spec (ErrSpecConflict, Permanent). It does not own retries, reconcile loops or garbage
// collection: those belong to the embedding program, which uses the error
// classes and List to drive them. It imports only the standard library.
//
// # Error classes
//
// Every error carries exactly one class, and Code and errors.Is agree on it:
// Code(err) is Transient, Permanent or NotFound exactly when errors.Is(err,
// ErrTransient / ErrPermanent / ErrNotFound) holds, and no other class
// sentinel matches. The sentinels are classed themselves (Code(ErrNotFound) is
// NotFound; ErrClosed and ErrSpecConflict are Permanent), so wrapping one with
// fmt.Errorf keeps its class. WithCode and Errorf give an error one class and
// hide every class inside it. An error without a class is Unknown (Canceled
// or DeadlineExceeded when it wraps a context error); providers do not return
// such errors, and egressproxy.Client classes them Transient. Code's doc says
// which class wins when an errors.Join holds several.
//
// # Error text
//
// Errors wrap once per layer, and each layer says only what the layer above
// does not already say. egressproxy.Client says the operation and the
// instance ("egressproxy get proxy-1: "); a backend says its name and entry
// and what failed, never the operation or the instance name again ("kvm2
// hv1: look up domain …", "memprovider: no instance with UID …"); a
// validation error says the field, the offending value and the rule
// ("invalid Name "Proxy_1": may contain only …"). So a Get of a missing kvm2
// instance reads
//
//	egressproxy get proxy-1: kvm2 hv1: look up domain "ep-hv1--proxy-1": <libvirt's text>
//
// Caller input that enters an error is quoted with Quote: escaped as
// strconv.Quote does and cut to MaxQuoted bytes followed by its length, so a
// huge or non-UTF-8 name prints as a short, valid, one-line value. The text
// of every error egressproxy.Client returns, and of every *Error and
// FieldError (so of every error a Provider returns, since each is classed
// with WithCode or Errorf), is valid UTF-8 of at most MaxErrorText (1 KiB)
// bytes, whatever the input: those types pass their text through
// ClipMessage, which repairs invalid UTF-8 and cuts a longer text, marking the
// cut with the full length. Kubernetes events and conditions, which cap their
// size, can take such a text as it is.
package provider

import (
	"context"
	"time"
)

// State is the lifecycle state of an instance as read from the backend.
// A missing instance is not a state: it is ErrNotFound.
type State string

const (
	// StateProvisioning: the instance exists and is starting; it has no
	// address yet.
	StateProvisioning State = "Provisioning"
	// StateRunning: the instance runs and has an address.
	StateRunning State = "Running"
	// StateStopped: the instance exists but does not run: stopped by
	// someone, or left defined but never started by a Create that was
	// interrupted. Either way, Create with the same spec starts it (Create
	// converges), so a reconciler that wants the instance running calls
	// Create again for a Stopped instance rather than waiting.
	StateStopped State = "Stopped"
	// StateFailed: the backend reports the instance as crashed or broken.
	StateFailed State = "Failed"
)

// Ref names one instance. Name is the instance name given in its Spec; UID
// is the identity it was created with. A backend object with that name but
// another UID is not the instance: operations treat it as missing.
type Ref struct {
	Name string
	UID  string
}

// Instance is an instance as read back from the backend.
type Instance struct {
	Ref
	// CreatedAt is the creation time recorded on the backend (UTC,
	// second precision or better).
	CreatedAt time.Time
	// State is the state read from the backend.
	State State
	// IP is the guest address, empty while Provisioning.
	IP string
	// Port is the proxy port the instance serves (from its Spec).
	Port int
	// AddressSource names where the address was found ("agent", "lease",
	// "arp", "static", ...); empty when IP is empty.
	AddressSource string
	// SpecDigest is the Spec.Digest of the spec the instance was created
	// from, as recorded by the backend; empty when the backend holds no
	// record of it (for kvm2: a domain created before the library
	// recorded digests). An embedder that wants to see drift without
	// calling Create compares it with the digest of its current spec.
	SpecDigest string
}

// Address returns "IP:Port", or "" when the instance has no address.
func (i Instance) Address() string {
	if i.IP == "" {
		return ""
	}
	return joinHostPort(i.IP, i.Port)
}

// HealthReason names why a provider is unhealthy. The zero value means
// healthy.
type HealthReason string

const (
	ReasonNone                   HealthReason = ""
	ReasonCredentialsUnavailable HealthReason = "CredentialsUnavailable" // key file missing or unreadable
	ReasonUnauthorized           HealthReason = "Unauthorized"           // the backend refused our credentials
	ReasonHostKeyUnknown         HealthReason = "HostKeyUnknown"         // the host is not in known_hosts
	ReasonHostKeyMismatch        HealthReason = "HostKeyMismatch"        // known_hosts pins another key
	ReasonForbidden              HealthReason = "Forbidden"              // authenticated but not allowed to use the API
	ReasonPoolNotActive          HealthReason = "PoolNotActive"          // the storage pool exists but is not running
	ReasonPoolNotFound           HealthReason = "PoolNotFound"           // the storage pool does not exist
	ReasonUnreachable            HealthReason = "Unreachable"            // network, daemon down, link dead
	ReasonUnknown                HealthReason = "Unknown"                // anything else; see Message
)

// Health is the state of a provider entry, found without creating anything.
type Health struct {
	// Reachable is true when the backend answered and can create instances.
	Reachable bool
	// Reason is ReasonNone when Reachable, otherwise the cause.
	Reason HealthReason
	// Message is a human-readable explanation (the underlying error).
	Message string
	// Details are backend facts, e.g. for kvm2: "hostname",
	// "libvirtVersion", "poolState", "poolFreeGiB".
	Details map[string]string
	// CheckedAt is when the check finished.
	CheckedAt time.Time
}

// Provider manages proxy instances on one backend entry (for kvm2: one
// hypervisor host and storage pool). All methods are safe for concurrent use
// and honour ctx: when ctx ends, a call returns promptly with an error for
// which Code is Canceled or DeadlineExceeded.
//
// Callers guarantee that Specs passed to Create are valid (Spec.Validate);
// the portable client egressproxy.Client does that. Providers validate again
// and return ErrPermanent naming the field for a bad Spec, before touching a
// backend.
type Provider interface {
	// Create makes the instance described by spec and starts it. It is
	// idempotent on spec.UID: if an instance with this name and UID
	// exists and was created from the same spec (same Spec.Digest), it is
	// returned unchanged, never duplicated; if it was created from another
	// spec, Create fails with ErrSpecConflict (Permanent) and changes
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
	Create(ctx context.Context, spec Spec) (Instance, error)
	// Get reads the instance back from the backend every time (UID,
	// creation time, state, address, spec digest). Errors: NotFound (missing, or the
	// name belongs to another UID or owner), Transient (backend
	// unreachable, or every address source failed), context codes.
	Get(ctx context.Context, ref Ref) (Instance, error)
	// Delete removes the instance and its own volumes; never a shared base
	// image. Deleting a missing instance succeeds (nil). Errors:
	// Transient, Permanent (backend refuses), context codes.
	Delete(ctx context.Context, ref Ref) error
	// List returns every instance this provider entry owns, and only
	// those, with Name, UID, CreatedAt and State (addresses may be left
	// empty). Errors: Transient, context codes.
	List(ctx context.Context) ([]Instance, error)
	// Check reports provider health without creating anything. An
	// unhealthy backend is reported in Health with a Reason, not as an
	// error; the error is for the call itself (context ended, provider
	// closed).
	Check(ctx context.Context) (Health, error)
	// Close releases every connection and goroutine. It does not delete
	// instances. Calls after Close return an error wrapping ErrClosed,
	// classed Permanent. Close is idempotent.
	Close() error
}
