// Package kvm2 is the libvirt-over-SSH Provider: it runs egress proxy VMs on
// one hypervisor host and one libvirt storage pool (a "provider entry").
//
// What it owns: reaching libvirtd through an SSH connection (package sshconn,
// no virsh, no remote shell), provider health (Check), and — in the lifecycle
// — the domain definition built from libvirt.org/go/libvirtxml structs, the
// qcow2 overlay and the cloud-init NoCloud seed of each instance, the
// library's metadata namespace on every domain it creates (UID, creation
// time, entry, owner), and address discovery (guest agent, then DHCP lease,
// then ARP).
//
// What it does not own: base images (package imagecache fetches, verifies and
// publishes them), retries, reconcile loops and garbage collection (the
// embedder drives those with the error classes of package provider and List).
//
// Image fan-out is on by default: entries of one process whose hosts need
// the same cold image at once share one download, and an entry going cold
// later copies another entry's published base instead of downloading it
// (an image with a configured SHA256); each host still verifies and
// publishes its own base. Options.PrivateImageCache turns it off for an
// entry.
//
// Names on the host: instance <name> of entry <entry> is the domain
// "ep-<entry>--<name>" with the overlay "ep-<entry>--<name>.qcow2" and the
// seed "ep-<entry>--<name>-seed.iso" ("--" cannot occur in an entry or a
// name, so the mapping is injective, and no name can collide with
// imagecache's "base-" volumes). Ownership is decided by the metadata element
// of namespace MetadataNamespace (UID, creation time, entry, owner, port, and
// the digest of the spec it was created from), never by the name: domains
// without it, with another entry or owner, or with another namespace are
// never listed, read or deleted.
//
// Create converges instead of undoing on uncertainty: a Create interrupted at
// any RPC (context ended, Close, link lost) removes nothing, and the next
// Create of the same spec reuses what it finds — an overlay backed by the
// same base, a seed volume (uploaded again), a domain of this UID (started if
// it never ran, its missing volumes recreated). "Exists already" and
// "already running" from another replica's concurrent Create are
// convergence; a race it cannot resolve (a volume still being written, a
// concurrent Delete) is Transient. Only what a Create made itself is removed
// when a step fails for certain, and a volume never while a domain of its
// name exists. An existing instance whose recorded spec digest differs is
// provider.ErrSpecConflict; domains without one (made by earlier versions)
// are not checked.
//
// Acceleration: a zero Config.DomainType defines kvm domains when the host's
// domain capabilities offer KVM and qemu (TCG) domains otherwise, which
// Check reports as degraded. A host may offer KVM that does not work (nested
// virtualisation): pin "qemu" there (docs/config.md).
//
// Lifecycle: Open validates the Config and builds the provider without
// touching the host (so Check can report an unreachable host); the first call
// dials. Every error is classed (provider.Code): Transient, Permanent,
// NotFound, Canceled, DeadlineExceeded. Close releases every connection and
// goroutine; calls after Close fail with provider.ErrClosed, classed
// Permanent.
//
// The library writes nothing to stdout or stderr: logging goes only to the
// logr.Logger in Options, tracing to its trace.TracerProvider: one span per
// public operation (kvm2.Create, kvm2.Get, …) over kvm2.libvirt.* spans,
// listed in docs/observability.md.
package kvm2
