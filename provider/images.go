package provider

import "context"

// ImageManager is an optional interface a Provider may implement (in the
// style of database/sql/driver's optional interfaces) to let its user see
// and manage the base images it keeps for instances: list them, prove the
// stored bytes, and evict one that is no longer wanted. egressproxy.Client
// exposes it as Client.ListImages, Client.VerifyImage and Client.EvictImage,
// and returns an error wrapping ErrNotSupported (Permanent) for a provider
// that does not implement it. providertest runs its conformance cases for
// every provider that does.
type ImageManager interface {
	// ListImages returns the base images of the provider's configured image
	// keys, one per key, sorted by Key; an image key whose base is not
	// present has Present false. Errors: Transient (backend unreachable),
	// context codes.
	ListImages(ctx context.Context) ([]ImageInfo, error)
	// VerifyImage reads the stored base of the image key back from the
	// backend, hashes it, and returns it with Verified true when the bytes
	// match the recorded digest. Errors: NotFound (the key is configured
	// but has no base yet), Permanent (unknown key, or stored bytes differ
	// from the recorded digest: nothing is deleted, instances may use it),
	// Transient, context codes.
	VerifyImage(ctx context.Context, key string) (ImageInfo, error)
	// EvictImage removes the stored base of the image key, so the next
	// Create that needs it fetches it again. It refuses, Permanent, naming
	// the users, while any instance (running or not) uses the base.
	// Evicting a key that has no base is not an error. Errors: Permanent
	// (unknown key, in use), Transient, context codes.
	EvictImage(ctx context.Context, key string) error
}

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
	// Verified is true only in VerifyImage's result, when the bytes read
	// back matched Digest.
	Verified bool `json:"verified,omitempty"`
}
