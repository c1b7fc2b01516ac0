// Package libvirterr is the one table that gives an error from libvirt, or
// from the SSH link under it, its provider class and, for Check, its health
// reason. kvm2 and imagecache both classify through it, so the same libvirt
// failure has the same class wherever it surfaces.
//
// The rules, in order (Of):
//
//  1. nil is OK; an error that already carries a provider class keeps it
//     (an explicit class wins over anything inferred);
//  2. context errors are Canceled / DeadlineExceeded (the caller's context;
//     the module's own budgets, DialTimeout and CallTimeout, come as a
//     *budget.TimeoutError instead, Transient with ReasonUnreachable, with
//     or without an sshconn kind around it);
//  3. sshconn kinds: unreachable is Transient (whatever libvirt code it
//     wraps); closed and config are Permanent; key unreadable, auth refused,
//     host key unknown or mismatch are Permanent (a human must fix
//     credentials or known_hosts), each with its health reason; forbidden is
//     Transient (OpenSSH gives the same answer while libvirtd's socket is
//     absent, e.g. during a restart);
//  4. a dead link seen without sshconn's help (go-libvirt's interrupted, or
//     EINVAL after its socket closed, EOF, closed pipe, network errors) is
//     Transient, whatever libvirt code also appears;
//  5. the pool-not-active marker (ErrPoolInactive, or libvirt's "storage
//     pool '…' is not active") is Permanent: a human must start the pool;
//  6. libvirt error numbers: the table below (Table); a number it does not
//     list is Transient;
//  7. anything else is Transient (a retry is the safe default).
//
// A fault of the entry itself — its credentials (key unreadable, auth
// refused), its host's key (unknown, changed), its rights on the host
// (libvirt's access and operation denials), its pool, its link — has one
// class on every operation (Verdict.Entry). Every other libvirt answer
// concerns the object a call names; ClassifyRead demotes such an answer
// from Permanent to Transient, never an entry's fault.
//
// A libvirt "no such object" (no domain, no storage volume, no domain
// metadata) is NotFound in the table, and Verdict.Missing says so. Only a
// call whose subject is that object may return NotFound (kvm2's Get of an
// instance); a call for which the missing object is a step, not the subject
// (a volume gone underneath an image fetch, a Delete that finds nothing),
// handles Missing itself. A missing storage pool is never NotFound: it is
// the entry's configuration that is wrong (Permanent, ReasonPoolNotFound).
package libvirterr
