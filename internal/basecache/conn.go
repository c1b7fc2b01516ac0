package basecache

import (
	"context"
	"io"

	"github.com/digitalocean/go-libvirt"
	"github.com/egressproxy/egressproxy/internal/libvirtconn"
)

// Libvirt is what the cache calls on a libvirt session: a subset of
// go-libvirt's *libvirt.Libvirt, with the same signatures, so a
// *libvirt.Libvirt is one. The storage pool and volume calls, the two
// stream calls (StorageVolUpload, StorageVolDownload) and the copy of a
// volume inside the host (StorageVolCreateXMLFrom), which the cache makes
// only on a Dedicated session, and the two domain calls that find the
// domains backed by a base. Errors are go-libvirt's: a libvirt.Error whose
// Code is a libvirt.ErrorNumber for an answer of libvirtd, anything else for
// a failure to reach it.
//
// internal/testing/libvirtfake implements it in memory, for tests.
type Libvirt interface {
	ConnectListAllStoragePools(NeedResults int32, Flags libvirt.ConnectListAllStoragePoolsFlags) (rPools []libvirt.StoragePool, rRet uint32, err error)
	StoragePoolLookupByName(Name string) (rPool libvirt.StoragePool, err error)
	StoragePoolIsActive(Pool libvirt.StoragePool) (rActive int32, err error)
	StoragePoolGetXMLDesc(Pool libvirt.StoragePool, Flags libvirt.StorageXMLFlags) (rXML string, err error)
	StoragePoolGetInfo(Pool libvirt.StoragePool) (rState uint8, rCapacity uint64, rAllocation uint64, rAvailable uint64, err error)
	StoragePoolRefresh(Pool libvirt.StoragePool, Flags uint32) (err error)
	StoragePoolListAllVolumes(Pool libvirt.StoragePool, NeedResults int32, Flags uint32) (rVols []libvirt.StorageVol, rRet uint32, err error)

	StorageVolLookupByName(Pool libvirt.StoragePool, Name string) (rVol libvirt.StorageVol, err error)
	StorageVolCreateXML(Pool libvirt.StoragePool, XML string, Flags libvirt.StorageVolCreateFlags) (rVol libvirt.StorageVol, err error)
	StorageVolCreateXMLFrom(Pool libvirt.StoragePool, XML string, Clonevol libvirt.StorageVol, Flags libvirt.StorageVolCreateFlags) (rVol libvirt.StorageVol, err error)
	StorageVolDelete(Vol libvirt.StorageVol, Flags libvirt.StorageVolDeleteFlags) (err error)
	StorageVolGetPath(Vol libvirt.StorageVol) (rName string, err error)
	StorageVolGetXMLDesc(Vol libvirt.StorageVol, Flags uint32) (rXML string, err error)
	StorageVolGetInfoFlags(Vol libvirt.StorageVol, Flags uint32) (rType int8, rCapacity uint64, rAllocation uint64, err error)
	StorageVolUpload(Vol libvirt.StorageVol, outStream io.Reader, Offset uint64, Length uint64, Flags libvirt.StorageVolUploadFlags) (err error)
	StorageVolDownload(Vol libvirt.StorageVol, inStream io.Writer, Offset uint64, Length uint64, Flags libvirt.StorageVolDownloadFlags) (err error)

	ConnectListAllDomains(NeedResults int32, Flags libvirt.ConnectListAllDomainsFlags) (rDomains []libvirt.Domain, rRet uint32, err error)
	DomainGetXMLDesc(Dom libvirt.Domain, Flags libvirt.DomainXMLFlags) (rXML string, err error)
}

var _ Libvirt = (*libvirt.Libvirt)(nil)

// Conn is the cache's link to one libvirtd: a shared session for short
// calls and dedicated sessions for streams. SSH adapts a libvirt session over SSH;
// tests use an in-memory one (internal/testing/libvirtfake). Implementations must
// be safe for concurrent use.
type Conn interface {
	// Do runs fn with the shared session. When ctx ends before fn
	// returns, Do returns promptly with an error wrapping ctx.Err() and
	// fn may go on running: the caller reads what fn writes only when Do
	// returned nil (then fn has finished and everything it wrote happened
	// before Do returned). fn's own error is returned unchanged, or
	// wrapped when the session was lost (sshconn: *sshconn.Error, which
	// the cache retries cleanups on).
	Do(ctx context.Context, fn func(Libvirt) error) error
	// Dedicated opens a session of its own, for one stream call, bounded
	// by ctx (only the opening: the session outlives ctx). The caller
	// closes it.
	Dedicated(ctx context.Context) (Dedicated, error)
}

// Dedicated is a libvirt session of its own, for one long stream call.
type Dedicated interface {
	// Libvirt is the session; its calls may be made directly (no Do).
	Libvirt() Libvirt
	// Close ends the session; it never blocks on a dead peer. Calling it
	// again, or after Kill, is allowed.
	Close() error
	// Kill ends the session at once: calls blocked on it return with an
	// error. Close is still to be called.
	Kill()
}

// SSH adapts l for New: the shared session is l.Do's, a dedicated session
// is l.Dedicated's (its own SSH connection). SSH(nil) returns nil, which
// New refuses.
func SSH(l *libvirtconn.Session) Conn {
	if l == nil {
		return nil
	}
	return sshConn{l}
}

type sshConn struct{ l *libvirtconn.Session }

func (s sshConn) Do(ctx context.Context, fn func(Libvirt) error) error {
	return s.l.Do(ctx, func(l *libvirt.Libvirt) error { return fn(l) })
}

func (s sshConn) Dedicated(ctx context.Context) (Dedicated, error) {
	d, err := s.l.Dedicated(ctx)
	if err != nil {
		return nil, err
	}
	return sshDedicated{d}, nil
}

// sshDedicated is a *libvirtconn.Dedicated as a Dedicated: go-libvirt's
// calls, except the two stream calls, which libvirtconn makes itself without
// go-libvirt's per-packet and per-call buffers (the cold fetch's memory).
type sshDedicated struct{ d *libvirtconn.Dedicated }

func (s sshDedicated) Libvirt() Libvirt { return dedicatedLibvirt{s.d.L, s.d} }

type dedicatedLibvirt struct {
	*libvirt.Libvirt
	d *libvirtconn.Dedicated
}

func (l dedicatedLibvirt) StorageVolUpload(vol libvirt.StorageVol, src io.Reader, offset, length uint64, flags libvirt.StorageVolUploadFlags) error {
	return l.d.StorageVolUpload(vol, src, offset, length, flags)
}

func (l dedicatedLibvirt) StorageVolDownload(vol libvirt.StorageVol, w io.Writer, offset, length uint64, flags libvirt.StorageVolDownloadFlags) error {
	return l.d.StorageVolDownload(vol, w, offset, length, flags)
}

func (s sshDedicated) Close() error { return s.d.Close() }
func (s sshDedicated) Kill()        { s.d.Kill() }
