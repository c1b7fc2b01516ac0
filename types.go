package egressproxy

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"strconv"
	"time"

	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/naming"
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
	// Capacity is what the entry has room for, as this check found it;
	// nil when the check could not learn it (always when not Reachable).
	Capacity *Capacity
	// CheckedAt is when the check finished.
	CheckedAt time.Time
}

// Capacity is what an entry's host has room for, as one Check found it:
// the facts a fleet places instances by. Each backend documents where its
// figures come from.
type Capacity struct {
	// MemoryAvailableBytes is the memory the host can give new guests
	// without swapping: its free memory plus buffers and page cache.
	MemoryAvailableBytes int64
	// CPUs is the number of logical CPUs of the host, which the guests'
	// vCPUs share.
	CPUs int
	// Instances is the number of the owner's instances on the entry that
	// run (Running or Provisioning), as List would count them.
	Instances int
	// PoolAvailableBytes is the free space of the storage the entry puts
	// instances' disks on.
	PoolAvailableBytes int64
}

// Spec describes an instance to create.
type Spec struct {
	// Name of the instance: a lowercase DNS label (1–63 of a–z, 0–9, '-',
	// starting and ending with a letter or digit, no "--"), so it is a safe
	// component of backend object and volume names. Required.
	Name string
	// UID is the instance identity Create is idempotent on (e.g. a
	// Kubernetes object UID). 1–128 bytes of valid UTF-8 without control
	// characters. Required.
	UID string
	// Port the proxy listens on in the instance. Zero means DefaultPort;
	// otherwise 1–65535.
	Port int
	// ImageKey selects the base image from the provider's configured
	// images: 1–63 of a–z, 0–9, '.', '-', starting and ending with a letter
	// or digit, no "--". Empty means the provider's default image.
	ImageKey string
	// MachineType selects vCPUs and memory from the provider's configured
	// machine types; same shape as ImageKey. Empty means the provider's
	// default.
	MachineType string
	// UserData is the cloud-init user-data given to the instance, at most
	// MaxUserDataBytes. Optional.
	UserData string
}

// Validate checks every field and returns all violations joined (each a
// *FieldError), classed Permanent; nil when the spec is valid.
func (s Spec) Validate() error {
	var bad []error
	if err := naming.ValidateName("Name", s.Name); err != nil {
		bad = append(bad, err)
	}
	if err := naming.ValidateUID(s.UID); err != nil {
		bad = append(bad, err)
	}
	if s.Port < 0 || s.Port > 65535 {
		bad = append(bad, &errs.FieldError{Field: "Port", Value: strconv.Itoa(s.Port), Rule: "must be 0 (default 3128) or 1-65535"})
	}
	if s.ImageKey != "" {
		if err := naming.ValidateKey("ImageKey", s.ImageKey); err != nil {
			bad = append(bad, err)
		}
	}
	if s.MachineType != "" {
		if err := naming.ValidateKey("MachineType", s.MachineType); err != nil {
			bad = append(bad, err)
		}
	}
	if len(s.UserData) > naming.MaxUserDataBytes {
		bad = append(bad, &errs.FieldError{Field: "UserData", Rule: fmt.Sprintf("is %d bytes, at most %d allowed", len(s.UserData), naming.MaxUserDataBytes)})
	}
	if len(bad) == 0 {
		return nil
	}
	return errs.WithCode(errs.Permanent, errors.Join(bad...))
}

// EffectivePort returns s.Port, or DefaultPort when it is zero.
func (s Spec) EffectivePort() int {
	if s.Port == 0 {
		return naming.DefaultPort
	}
	return s.Port
}

// specDigestDomain starts the hashed encoding of Digest; a future encoding
// gets another domain string (and the digest another prefix).
const specDigestDomain = "egressproxy.dev/spec/v1"

// Digest returns a stable digest of the spec: "sha256:" and 64 lowercase
// hex digits, the SHA-256 of a versioned encoding in which every field is
// length-prefixed (so no two specs share an encoding): Name, UID,
// EffectivePort, ImageKey, MachineType, UserData, in that order. Port is
// normalised (0 and DefaultPort digest alike); nothing else is: an empty
// ImageKey or MachineType (the provider's default) digests differently
// from the key it resolves to today, since the provider's default may
// change. The value depends only on the spec, never on the process, the
// platform or the release: providers record it at creation
// (Instance.SpecDigest) and compare it on Create (ErrSpecConflict). It is
// not a secret-keeping device: it only fingerprints the spec.
func (s Spec) Digest() string {
	h := sha256.New()
	var n [8]byte
	put := func(v string) {
		binary.BigEndian.PutUint64(n[:], uint64(len(v)))
		h.Write(n[:])
		h.Write([]byte(v))
	}
	put(specDigestDomain)
	for _, v := range []string{s.Name, s.UID, strconv.Itoa(s.EffectivePort()), s.ImageKey, s.MachineType, s.UserData} {
		put(v)
	}
	return "sha256:" + hex.EncodeToString(h.Sum(nil))
}

// Ref returns the Ref of the instance the spec describes.
func (s Spec) Ref() Ref { return Ref{Name: s.Name, UID: s.UID} }

func joinHostPort(ip string, port int) string { return net.JoinHostPort(ip, strconv.Itoa(port)) }

// ImageInfo describes one base image as the backend stores it.
type ImageInfo struct {
	// Key is the image key (Spec.ImageKey).
	Key string `json:"key"`
	// Name is the backend's name of the stored base (for kvm2 the volume
	// name); "" when not Present.
	Name string `json:"name,omitempty"`
	// Present reports whether a usable base is stored.
	Present bool `json:"present"`
	// Digest is the lowercase hex sha256 of the stored bytes as recorded
	// when the base was published; "" when not Present.
	Digest string `json:"digest,omitempty"`
	// SizeBytes is the stored size in bytes; 0 when not Present.
	SizeBytes int64 `json:"sizeBytes,omitempty"`
	// InUseBy are the names of the instances whose disks use the base,
	// sorted. A user that is not one of the provider's instances is named
	// in a form the backend documents that no instance name can take (kvm2:
	// "domain/<libvirt domain name>"); EvictImage refuses while it is
	// listed.
	InUseBy []string `json:"inUseBy,omitempty"`
	// InUseUnknown reports that the backend cannot tell every user of the
	// base: InUseBy lists the users it found and others may exist (kvm2: a
	// disk on the host whose backing chain it cannot follow, such as an
	// inactive domain's overlay outside every active pool). Read it as
	// "in use: unknown", never as unused; EvictImage refuses while it is
	// set. False when nothing is stored for the key.
	InUseUnknown bool `json:"inUseUnknown,omitempty"`
	// Verified is true only in VerifyImage's result, when the bytes read
	// back matched Digest.
	Verified bool `json:"verified,omitempty"`
}
