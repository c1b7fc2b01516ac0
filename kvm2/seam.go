package kvm2

import (
	"context"
	"errors"
	"io"

	libvirt "github.com/digitalocean/go-libvirt"
	"github.com/go-logr/logr"
	"go.opentelemetry.io/otel/trace"

	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/basecache"
	"github.com/egressproxy/egressproxy/internal/libvirtconn"
	"github.com/egressproxy/egressproxy/sshconn"
)

// The seam between the provider and what it drives: Open builds the real
// ones (go-libvirt over SSH, imagecache); the unit tests build a
// Provider on in-memory fakes through newProvider.

// lvAPI is the part of go-libvirt's *libvirt.Libvirt that kvm2 calls, with
// its signatures.
type lvAPI interface {
	ConnectGetHostname() (string, error)
	ConnectGetLibVersion() (uint64, error)
	ConnectListAllDomains(needResults int32, flags libvirt.ConnectListAllDomainsFlags) ([]libvirt.Domain, uint32, error)
	ConnectGetAllDomainStats(doms []libvirt.Domain, stats uint32, flags uint32) ([]libvirt.DomainStatsRecord, error)
	ConnectGetDomainCapabilities(emulatorbin, arch, machine, virttype libvirt.OptString, flags libvirt.ConnectGetDomainCapabilitiesFlags) (string, error)

	DomainLookupByName(name string) (libvirt.Domain, error)
	DomainGetXMLDesc(dom libvirt.Domain, flags libvirt.DomainXMLFlags) (string, error)
	DomainGetState(dom libvirt.Domain, flags uint32) (int32, int32, error)
	DomainDefineXMLFlags(xml string, flags libvirt.DomainDefineFlags) (libvirt.Domain, error)
	DomainCreate(dom libvirt.Domain) error
	DomainDestroy(dom libvirt.Domain) error
	DomainUndefineFlags(dom libvirt.Domain, flags libvirt.DomainUndefineFlagsValues) error
	DomainInterfaceAddresses(dom libvirt.Domain, source uint32, flags uint32) ([]libvirt.DomainInterface, error)

	NodeGetInfo() (rModel [32]int8, rMemory uint64, rCpus int32, rMhz int32, rNodes int32, rSockets int32, rCores int32, rThreads int32, err error)
	NodeGetMemoryStats(Nparams int32, CellNum int32, Flags uint32) (rParams []libvirt.NodeGetMemoryStats, rNparams int32, err error)

	StoragePoolLookupByName(name string) (libvirt.StoragePool, error)
	StoragePoolRefresh(pool libvirt.StoragePool, flags uint32) error
	StoragePoolGetInfo(pool libvirt.StoragePool) (uint8, uint64, uint64, uint64, error)

	StorageVolLookupByName(pool libvirt.StoragePool, name string) (libvirt.StorageVol, error)
	StorageVolCreateXML(pool libvirt.StoragePool, xml string, flags libvirt.StorageVolCreateFlags) (libvirt.StorageVol, error)
	StorageVolGetXMLDesc(vol libvirt.StorageVol, flags uint32) (string, error)
	StorageVolGetInfo(vol libvirt.StorageVol) (int8, uint64, uint64, error)
	StorageVolUpload(vol libvirt.StorageVol, outStream io.Reader, offset, length uint64, flags libvirt.StorageVolUploadFlags) error
	StorageVolDelete(vol libvirt.StorageVol, flags libvirt.StorageVolDeleteFlags) error
}

var _ lvAPI = (*libvirt.Libvirt)(nil)

// lvSession runs calls on the shared libvirt connection, with
// libvirtconn.Session.Do's contract: fn may outlive Do when ctx ends, so
// the caller reads what fn writes only when Do returned nil; after Close,
// Do fails with an sshconn KindClosed error.
type lvSession interface {
	Do(ctx context.Context, fn func(lvAPI) error) error
	Close() error
}

// sshSession is the real lvSession: the entry's libvirt session and the
// SSH pool under it (which the libvirt session does not own).
type sshSession struct {
	lv   *libvirtconn.Session
	pool *sshconn.Pool
}

func (s *sshSession) Do(ctx context.Context, fn func(lvAPI) error) error {
	return s.lv.Do(ctx, func(l *libvirt.Libvirt) error { return fn(l) })
}

// Close closes the libvirt session, then the SSH pool.
func (s *sshSession) Close() error {
	lerr := s.lv.Close()
	perr := s.pool.Close()
	return errors.Join(lerr, perr)
}

// imageCache is what kvm2 needs of the entry's *basecache.Cache.
type imageCache interface {
	Ensure(ctx context.Context, img imagecache.Image) (basecache.Base, error)
	// UsePool hands the cache the entry's pool handle kvm2 looked up, so
	// that the cache's first call does not look it up again.
	UsePool(pool libvirt.StoragePool)
	// List, Verify and Evict serve provider.ImageManager (imagemgr.go).
	List(ctx context.Context) ([]basecache.Entry, error)
	Verify(ctx context.Context, img imagecache.Image) (basecache.Base, error)
	Evict(ctx context.Context, img imagecache.Image) error
	Close() error
}

var _ imageCache = (*basecache.Cache)(nil)

// newProvider builds a Provider of the validated cfg on sess and images.
func newProvider(cfg Config, log logr.Logger, tracer trace.Tracer, sess lvSession, images imageCache) *provider {
	return &provider{
		cfg:    cfg,
		log:    log.WithName("kvm2"),
		tracer: tracer,
		lv:     sess,
		cache:  images,
	}
}
