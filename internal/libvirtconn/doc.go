// Package libvirtconn carries go-libvirt over sshconn: a Session is one
// host's libvirtd reached through a unix socket channel of the Pool's
// shared SSH connection, for short calls, plus Dedicated connections, each
// on an SSH connection of its own, for long stream calls. kvm2 and the
// image cache use it; nothing here is part of the module's API.
//
// What it owns:
//
//   - Session.Do runs one piece of work with a context that go-libvirt
//     itself does not take, returning promptly when the context ends. A
//     call abandoned that way is abandoned for its caller only: the shared
//     connection stays up for everyone else and its late reply is
//     discarded; the connection is torn down only when liveness says it is
//     dead (the SSH link's keepalives, go-libvirt's disconnect, a probe of
//     an overdue abandoned call). It reconnects after libvirtd restarts or
//     the link dies, detecting a dead connection before running the work.
//   - A stream guard between go-libvirt and every channel, which keeps
//     go-libvirt's reply router from deadlocking on the stream packet
//     orders libvirtd really sends (docs/upstream.md).
//   - Dedicated.StorageVolUpload and StorageVolDownload: the two stream
//     calls made by this package itself on the dedicated connection's
//     channel, beside go-libvirt, without go-libvirt's buffer per packet and
//     per upload call, so a transfer's memory does not grow with its bytes.
//
// With Options.MeterProvider the stream guard, which sees every packet,
// times each remote procedure call from its header leaving to its reply
// (or the connection's loss), by procedure and class.
//
// Its errors are *sshconn.Error values, so that one classifier reads the
// SSH link's failures and the session's alike: a connection lost or a
// deadline run out is KindUnreachable, Close makes later calls KindClosed,
// a cancellation is KindUnknown. What libvirtd answers (a libvirt.Error)
// is returned unchanged.
//
// Close rules: Session.Close and Dedicated.Close never block on an
// unresponsive (even SIGSTOPped) peer: a channel whose close is not
// answered has its SSH connection killed, and goroutines are awaited for
// about a second at most. Session.Close does not close the Pool.
package libvirtconn
