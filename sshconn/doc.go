// Package sshconn is egressproxy's SSH transport to a hypervisor: it dials
// sshd with golang.org/x/crypto/ssh, always verifying the host key against
// known_hosts content (a file or bytes; plain and hashed names, patterns,
// @cert-authority for host certificates, @revoked), authenticates with a key
// from a file, from PEM bytes (optionally passphrase-protected), from an
// ssh.Signer or from an ssh-agent, keeps one shared connection per host
// alive and watched,
// and carries go-libvirt over a direct-streamlocal channel to libvirtd's
// unix socket (no virsh, no remote shell commands).
//
// What it owns:
//
//   - Pool: one shared *ssh.Client per host for short calls, dialed lazily,
//     with keepalive@openssh.com probes (KeepaliveCount intervals without an
//     answer declare the link dead), a Dead predicate, and redial with a
//     bounded exponential backoff between failed attempts. Dedicated
//     connections for long transfers. Kill to abandon the shared link.
//   - Libvirt: a go-libvirt session over the Pool; Do runs one piece of work
//     with a context that go-libvirt itself does not take, returning promptly
//     when the context ends. A call abandoned that way is abandoned for its
//     caller only: the shared session stays up for everyone else and its
//     late reply is discarded; the session is torn down only when liveness
//     says it is dead (keepalives, go-libvirt's disconnect, a probe of an
//     overdue abandoned call). It reconnects after libvirtd restarts or the
//     link dies, detecting a dead session before running the work.
//   - A stream guard between go-libvirt and every channel, which keeps
//     go-libvirt's reply router from deadlocking on the stream packet orders
//     libvirtd really sends (see streamguard.go and docs/upstream.md).
//   - DedicatedConn.StorageVolUpload and StorageVolDownload: the two stream
//     calls made by sshconn itself on the dedicated connection's channel,
//     beside go-libvirt, without go-libvirt's buffer per packet and per
//     upload call, so a transfer's memory does not grow with its bytes
//     (ownstream.go).
//   - Error classes: every classified failure is an *Error whose Kind says
//     why: key unreadable, auth refused, host unknown, host key mismatch,
//     unreachable, forbidden (the remote socket channel was refused), closed,
//     invalid config. KindOf(err) extracts it.
//
// Close rules: Pool.Close, Libvirt.Close and DedicatedConn.Close never block
// on an unresponsive (even SIGSTOPped) peer, and end the calls and dials in
// flight (a dial never outlives Close). A link is first declared dead
// (a channel is closed, releasing waiters), then its TCP connection is
// closed (unblocking every reader and writer), and only then anything that
// may wait; goroutines are awaited for about a second at most. Every
// goroutine the package starts ends by Close.
//
// What it does not own: retries of failed operations (beyond redialing the
// link on the next call), mapping Kinds to egressproxy's error classes
// (kvm2 does that), libvirt error codes, image transfers and their
// verification (imagecache), and the known_hosts content and keys themselves
// (the embedder provides them; there is no option to skip host key checks).
//
// Note: OpenSSH answers "open failed" both for a unix socket the user may
// not open and for one that does not exist (libvirtd down), so both are
// KindForbidden.
package sshconn
