// Package kvm2 runs egress proxy VMs on a libvirt host reached over SSH: one
// host and one libvirt storage pool make a provider entry.
//
// Open validates a Config (ParseConfig reads one from YAML or JSON) and
// returns the portable *egressproxy.Client without touching the host: the
// first call dials, so Check can report an unreachable host, unusable
// credentials or an unknown host key as a health reason. libvirtd is reached
// through pinned, pooled SSH (package sshconn); nothing runs a remote shell.
//
// Instance <name> of entry <entry> is the domain "ep-<entry>--<name>", with
// the qcow2 overlay "ep-<entry>--<name>.qcow2" over the entry's base image
// (package imagecache fetches, verifies and publishes it) and the cloud-init
// NoCloud seed "ep-<entry>--<name>-seed.iso" ("--" cannot occur in an entry
// or a name, so no two instances share a name). Ownership is decided by the
// domain's metadata element of namespace
// https://egressproxy.dev/xmlns/instance/v1 (UID, creation time, entry,
// owner, port, spec digest), never by the name: a domain without
// it, or of another entry or owner, is never listed, read or deleted. An
// instance's address comes from the guest agent, else the DHCP lease, else
// ARP (AddressError says why none was found).
//
// Create converges: after any interruption (the context ends, Close, the link
// drops, the process dies) a Create of the same spec completes the same
// instance, and Delete removes whatever an interrupted Create left. An
// existing instance created from another spec is egressproxy.ErrSpecConflict.
//
// Image fan-out is on by default: entries of one process whose hosts need
// the same cold image at once share one download, and an entry going cold
// later copies another entry's published base instead of downloading it
// (an image with a configured SHA256); each host still verifies and
// publishes its own base. Options.PrivateImageCache turns it off for an
// entry.
//
// Errors carry the classes of package egressproxy, one class per fault on
// every operation: a fault of the entry itself (credentials, host key,
// rights on the host, the storage pool) is Permanent; a lost link, or SSH
// refusing libvirtd's socket (as it does while libvirtd restarts), is
// Transient. A failed read of one instance is Transient, so it never marks
// a healthy instance failed.
//
// With the zero Config.DomainType, domains use KVM when the host offers it
// and QEMU's emulation otherwise, which Check reports as degraded. The
// entries of one process share the download of an image their hosts need at
// once (Options).
//
// The package writes nothing to stdout or stderr: logs go to
// Options.Logger, spans (kvm2.Create, kvm2.Get, … over kvm2.libvirt.*) to
// Options.TracerProvider, metrics (the client's operations and the entry's
// facts from Check, every libvirt call, the SSH connection, the image
// cache), each labelled with the entry, to Options.MeterProvider.
package kvm2
