package libvirtfake

import (
	"io"
	"path"
	"slices"
	"strings"

	"github.com/digitalocean/go-libvirt"
	"libvirt.org/go/libvirtxml"
)

// pool is one storage pool of "dir" type.
type pool struct {
	name     string
	uuid     libvirt.UUID
	target   string
	capacity uint64
	state    libvirt.StoragePoolState
	vols     map[string]*volume
}

// volume is one file volume; data is its content on the "host".
type volume struct {
	def      libvirtxml.StorageVolume // as created (name, target format, backing store)
	path     string
	capacity uint64
	data     []byte
}

func (p *pool) active() bool { return p.state == libvirt.StoragePoolRunning }

func (p *pool) allocation() uint64 {
	var n uint64
	for _, v := range p.vols {
		n += uint64(len(v.data))
	}
	return n
}

func (p *pool) available() uint64 {
	if a := p.allocation(); a < p.capacity {
		return p.capacity - a
	}
	return 0
}

// AddPool defines and starts a "dir" pool of capacity bytes with target
// directory "/pools/<name>".
func (h *Host) AddPool(name string, capacity uint64) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if _, ok := h.pools[name]; ok {
		return Errorf(libvirt.ErrOperationFailed, "operation failed: pool '%s' already exists", name)
	}
	h.pools[name] = &pool{name: name, uuid: h.uuidLocked(), target: "/pools/" + name, capacity: capacity, state: libvirt.StoragePoolRunning, vols: map[string]*volume{}}
	return nil
}

// SetPoolState puts a pool in state (its volumes are kept): only a
// StoragePoolRunning pool is active; any other state, including one
// libvirt does not define, is reported as it is.
func (h *Host) SetPoolState(name string, state libvirt.StoragePoolState) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	p, ok := h.pools[name]
	if !ok {
		return errNoPool(name)
	}
	p.state = state
	return nil
}

// RemovePool undefines a pool and forgets its volumes.
func (h *Host) RemovePool(name string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.pools, name)
}

// SetPoolCapacity sets a pool's size in bytes.
func (h *Host) SetPoolCapacity(name string, capacity uint64) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	p, ok := h.pools[name]
	if !ok {
		return errNoPool(name)
	}
	p.capacity = capacity
	return nil
}

// Volume is a volume as the Host holds it (Host.Volume, Host.PutVolume).
type Volume struct {
	Name string
	// Path is the file's path, "<pool target>/<name>" (PutVolume: that
	// when empty).
	Path string
	// Format is the target format (reading: "raw" when none was given).
	Format string
	// Capacity is the size in bytes (PutVolume: 0 means len(Data)).
	Capacity uint64
	// BackingPath and BackingFormat describe the backing store, if any.
	BackingPath, BackingFormat string
	// Data is the content.
	Data []byte
}

// VolumeNames returns the sorted names of the volumes of a pool (nil for
// a pool that does not exist), active or not.
func (h *Host) VolumeNames(pool string) []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	p, ok := h.pools[pool]
	if !ok {
		return nil
	}
	return sortedKeys(p.vols)
}

// Volume returns a copy of a volume of a pool, active or not.
func (h *Host) Volume(pool, name string) (Volume, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	p, ok := h.pools[pool]
	if !ok {
		return Volume{}, false
	}
	v, ok := p.vols[name]
	if !ok {
		return Volume{}, false
	}
	out := Volume{Name: name, Path: v.path, Format: "raw", Capacity: v.capacity, Data: slices.Clone(v.data)}
	if t := v.def.Target; t != nil && t.Format != nil && t.Format.Type != "" {
		out.Format = t.Format.Type
	}
	if b := v.def.BackingStore; b != nil {
		out.BackingPath = b.Path
		if b.Format != nil {
			out.BackingFormat = b.Format.Type
		}
	}
	return out, true
}

// PutVolume creates (or replaces) a volume of a pool, active or not,
// without hooks or checks: test setup.
func (h *Host) PutVolume(pool string, v Volume) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	p, ok := h.pools[pool]
	if !ok {
		return errNoPool(pool)
	}
	def := libvirtxml.StorageVolume{Name: v.Name}
	if v.Format != "" {
		def.Target = &libvirtxml.StorageVolumeTarget{Format: &libvirtxml.StorageVolumeTargetFormat{Type: v.Format}}
	}
	if v.BackingPath != "" {
		def.BackingStore = &libvirtxml.StorageVolumeBackingStore{Path: v.BackingPath}
		if v.BackingFormat != "" {
			def.BackingStore.Format = &libvirtxml.StorageVolumeTargetFormat{Type: v.BackingFormat}
		}
	}
	if v.Path == "" {
		v.Path = path.Join(p.target, v.Name)
	}
	if v.Capacity == 0 {
		v.Capacity = uint64(len(v.Data))
	}
	p.vols[v.Name] = &volume{def: def, path: v.Path, capacity: v.Capacity, data: slices.Clone(v.Data)}
	return nil
}

// SetVolumeData replaces the bytes of an existing volume of an active
// pool, keeping the volume (a stream writing to it goes on writing to it):
// to shorten or corrupt what was stored.
func (h *Host) SetVolumeData(pool, name string, data []byte) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	v, err := h.volLocked(libvirt.StorageVol{Pool: pool, Name: name})
	if err != nil {
		return err
	}
	v.data = slices.Clone(data)
	return nil
}

// RemoveVolume forgets a volume of a pool, active or not, without hooks.
func (h *Host) RemoveVolume(pool, name string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if p, ok := h.pools[pool]; ok {
		delete(p.vols, name)
	}
}

func errNoPool(name string) error {
	return Errorf(libvirt.ErrNoStoragePool, "Storage pool not found: no storage pool with matching name '%s'", name)
}

func errNoVol(name string) error {
	return Errorf(libvirt.ErrNoStorageVol, "Storage volume not found: no storage vol with matching name '%s'", name)
}

func errInactive(name string) error {
	return Errorf(libvirt.ErrOperationInvalid, "Requested operation is not valid: storage pool '%s' is not active", name)
}

func (h *Host) poolLocked(name string) (*pool, error) {
	p, ok := h.pools[name]
	if !ok {
		return nil, errNoPool(name)
	}
	return p, nil
}

// poolByHandleLocked finds the pool a handle names as libvirt does: by its
// UUID, so the handle of a pool that was undefined (and perhaps defined
// again under the same name) finds nothing.
func (h *Host) poolByHandleLocked(hd libvirt.StoragePool) (*pool, error) {
	p, ok := h.pools[hd.Name]
	if !ok || p.uuid != hd.UUID {
		return nil, Errorf(libvirt.ErrNoStoragePool, "Storage pool not found: no storage pool with matching uuid '%s' (%s)", uuidString(hd.UUID), hd.Name)
	}
	return p, nil
}

func (h *Host) activePoolByHandleLocked(hd libvirt.StoragePool) (*pool, error) {
	p, err := h.poolByHandleLocked(hd)
	if err != nil {
		return nil, err
	}
	if !p.active() {
		return nil, errInactive(hd.Name)
	}
	return p, nil
}

func (h *Host) activePoolLocked(name string) (*pool, error) {
	p, err := h.poolLocked(name)
	if err != nil {
		return nil, err
	}
	if !p.active() {
		return nil, errInactive(name)
	}
	return p, nil
}

func (h *Host) volLocked(v libvirt.StorageVol) (*volume, error) {
	p, err := h.activePoolLocked(v.Pool)
	if err != nil {
		return nil, err
	}
	vol, ok := p.vols[v.Name]
	if !ok {
		return nil, errNoVol(v.Name)
	}
	return vol, nil
}

// volByPathLocked finds the volume whose file is path, in any pool.
func (h *Host) volByPathLocked(path string) *volume {
	for _, p := range h.pools {
		for _, v := range p.vols {
			if v.path == path {
				return v
			}
		}
	}
	return nil
}

func (p *pool) handle() libvirt.StoragePool { return libvirt.StoragePool{Name: p.name, UUID: p.uuid} }

func (p *pool) volHandle(v *volume) libvirt.StorageVol {
	return libvirt.StorageVol{Pool: p.name, Name: v.def.Name, Key: v.path}
}

// ConnectListAllStoragePools lists the pools, sorted by name; flags
// ConnectListStoragePoolsActive/Inactive filter (none: all).
func (s *Session) ConnectListAllStoragePools(NeedResults int32, Flags libvirt.ConnectListAllStoragePoolsFlags) (rPools []libvirt.StoragePool, rRet uint32, err error) {
	err = s.run(Call{Method: "ConnectListAllStoragePools"}, func() error {
		s.h.mu.Lock()
		defer s.h.mu.Unlock()
		wantActive := Flags&libvirt.ConnectListStoragePoolsActive != 0
		wantInactive := Flags&libvirt.ConnectListStoragePoolsInactive != 0
		for _, name := range sortedKeys(s.h.pools) {
			p := s.h.pools[name]
			if (wantActive || wantInactive) && !(wantActive && p.active() || wantInactive && !p.active()) {
				continue
			}
			rPools = append(rPools, p.handle())
		}
		rRet = uint32(len(rPools))
		return nil
	})
	return rPools, rRet, err
}

// StoragePoolLookupByName finds a pool, active or not.
func (s *Session) StoragePoolLookupByName(Name string) (rPool libvirt.StoragePool, err error) {
	err = s.run(Call{Method: "StoragePoolLookupByName", Pool: Name}, func() error {
		s.h.mu.Lock()
		defer s.h.mu.Unlock()
		p, err := s.h.poolLocked(Name)
		if err != nil {
			return err
		}
		rPool = p.handle()
		return nil
	})
	return rPool, err
}

// StoragePoolIsActive is 1 for a running pool, 0 for any other.
func (s *Session) StoragePoolIsActive(Pool libvirt.StoragePool) (rActive int32, err error) {
	err = s.run(Call{Method: "StoragePoolIsActive", Pool: Pool.Name}, func() error {
		s.h.mu.Lock()
		defer s.h.mu.Unlock()
		p, err := s.h.poolByHandleLocked(Pool)
		if err != nil {
			return err
		}
		if p.active() {
			rActive = 1
		}
		return nil
	})
	return rActive, err
}

// StoragePoolGetXMLDesc is the pool's XML (type dir, target path, sizes).
func (s *Session) StoragePoolGetXMLDesc(Pool libvirt.StoragePool, Flags libvirt.StorageXMLFlags) (rXML string, err error) {
	err = s.run(Call{Method: "StoragePoolGetXMLDesc", Pool: Pool.Name}, func() error {
		s.h.mu.Lock()
		defer s.h.mu.Unlock()
		p, err := s.h.poolByHandleLocked(Pool)
		if err != nil {
			return err
		}
		x := libvirtxml.StoragePool{
			Type: "dir", Name: p.name, UUID: uuidString(p.uuid),
			Capacity:   &libvirtxml.StoragePoolSize{Unit: "bytes", Value: p.capacity},
			Allocation: &libvirtxml.StoragePoolSize{Unit: "bytes", Value: p.allocation()},
			Available:  &libvirtxml.StoragePoolSize{Unit: "bytes", Value: p.available()},
			Target:     &libvirtxml.StoragePoolTarget{Path: p.target},
		}
		rXML, err = x.Marshal()
		return err
	})
	return rXML, err
}

// StoragePoolGetInfo returns the state and sizes (the sizes are zero for a
// pool that is not running, as libvirtd reports them).
func (s *Session) StoragePoolGetInfo(Pool libvirt.StoragePool) (rState uint8, rCapacity uint64, rAllocation uint64, rAvailable uint64, err error) {
	err = s.run(Call{Method: "StoragePoolGetInfo", Pool: Pool.Name}, func() error {
		s.h.mu.Lock()
		defer s.h.mu.Unlock()
		p, err := s.h.poolByHandleLocked(Pool)
		if err != nil {
			return err
		}
		rState = uint8(p.state)
		if p.active() {
			rCapacity, rAllocation, rAvailable = p.capacity, p.allocation(), p.available()
		}
		return nil
	})
	return rState, rCapacity, rAllocation, rAvailable, err
}

// StoragePoolRefresh does nothing on a running pool.
func (s *Session) StoragePoolRefresh(Pool libvirt.StoragePool, Flags uint32) (err error) {
	return s.run(Call{Method: "StoragePoolRefresh", Pool: Pool.Name}, func() error {
		s.h.mu.Lock()
		defer s.h.mu.Unlock()
		_, err := s.h.activePoolByHandleLocked(Pool)
		return err
	})
}

// StoragePoolListAllVolumes lists a running pool's volumes, sorted by name.
func (s *Session) StoragePoolListAllVolumes(Pool libvirt.StoragePool, NeedResults int32, Flags uint32) (rVols []libvirt.StorageVol, rRet uint32, err error) {
	err = s.run(Call{Method: "StoragePoolListAllVolumes", Pool: Pool.Name}, func() error {
		s.h.mu.Lock()
		defer s.h.mu.Unlock()
		p, err := s.h.activePoolByHandleLocked(Pool)
		if err != nil {
			return err
		}
		for _, n := range sortedKeys(p.vols) {
			rVols = append(rVols, p.volHandle(p.vols[n]))
		}
		rRet = uint32(len(rVols))
		return nil
	})
	return rVols, rRet, err
}

// StorageVolLookupByName finds a volume of a running pool.
func (s *Session) StorageVolLookupByName(Pool libvirt.StoragePool, Name string) (rVol libvirt.StorageVol, err error) {
	err = s.run(Call{Method: "StorageVolLookupByName", Pool: Pool.Name, Volume: Name}, func() error {
		s.h.mu.Lock()
		defer s.h.mu.Unlock()
		p, err := s.h.activePoolByHandleLocked(Pool)
		if err != nil {
			return err
		}
		v, ok := p.vols[Name]
		if !ok {
			return errNoVol(Name)
		}
		rVol = p.volHandle(v)
		return nil
	})
	return rVol, err
}

// newVolumeLocked checks a volume definition (def, or perr when its XML
// did not parse) for a creation in Pool, as libvirt does: its name, its
// capacity, the pool active and the name free. h.mu is held.
func (h *Host) newVolumeLocked(Pool libvirt.StoragePool, def *libvirtxml.StorageVolume, perr error) (*pool, uint64, error) {
	if perr != nil {
		return nil, 0, Errorf(libvirt.ErrXMLError, "XML error: %v", perr)
	}
	if def.Name == "" {
		return nil, 0, Errorf(libvirt.ErrXMLError, "XML error: missing volume name element")
	}
	capacity, err := size(def.Capacity)
	if err != nil {
		return nil, 0, err
	}
	p, err := h.activePoolByHandleLocked(Pool)
	if err != nil {
		return nil, 0, err
	}
	if _, ok := p.vols[def.Name]; ok {
		return nil, 0, Errorf(libvirt.ErrStorageVolExist, "storage volume '%s' exists already", def.Name)
	}
	return p, capacity, nil
}

// StorageVolCreateXML creates an empty file volume from its XML (name
// required; capacity in any libvirt unit; target format and backing store
// kept for StorageVolGetXMLDesc). The name is taken atomically: an
// existing name fails with ErrStorageVolExist. A backing store must be the
// file of a volume (of any pool), as qemu-img opens it; an overlay without
// a capacity gets its backing store's.
func (s *Session) StorageVolCreateXML(Pool libvirt.StoragePool, XML string, Flags libvirt.StorageVolCreateFlags) (rVol libvirt.StorageVol, err error) {
	var def libvirtxml.StorageVolume
	perr := def.Unmarshal(XML)
	err = s.run(Call{Method: "StorageVolCreateXML", Pool: Pool.Name, Volume: def.Name}, func() error {
		s.h.mu.Lock()
		defer s.h.mu.Unlock()
		p, capacity, err := s.h.newVolumeLocked(Pool, &def, perr)
		if err != nil {
			return err
		}
		if bs := def.BackingStore; bs != nil {
			b := s.h.volByPathLocked(bs.Path)
			if b == nil {
				return Errorf(libvirt.ErrInternalError, "internal error: Child process (qemu-img create) unexpected exit status 1: Could not open backing file '%s': No such file or directory", bs.Path)
			}
			if capacity == 0 {
				capacity = b.capacity
			}
		}
		v := &volume{def: def, path: path.Join(p.target, def.Name), capacity: capacity}
		p.vols[def.Name] = v
		rVol = p.volHandle(v)
		return nil
	})
	return rVol, err
}

// StorageVolCreateXMLFrom creates a volume from its XML (as
// StorageVolCreateXML) holding a copy of Clonevol, a volume of any active
// pool of the Host, as libvirt's dir pools do: when both the clone's target
// format and Clonevol's format are raw, the copy is byte for byte (capacity
// the larger of the two); otherwise libvirt converts with qemu-img, and
// the copy's bytes differ from the original's — here, the original's
// followed by a zero cluster of 64 KiB. Clonevol's format is what libvirt
// probes: qcow2 when its bytes start with the qcow2 magic, else its
// definition's. A copy larger than the pool's free space fails as a full
// disk does, and nothing is created.
func (s *Session) StorageVolCreateXMLFrom(Pool libvirt.StoragePool, XML string, Clonevol libvirt.StorageVol, Flags libvirt.StorageVolCreateFlags) (rVol libvirt.StorageVol, err error) {
	var def libvirtxml.StorageVolume
	perr := def.Unmarshal(XML)
	err = s.run(Call{Method: "StorageVolCreateXMLFrom", Pool: Pool.Name, Volume: def.Name}, func() error {
		s.h.mu.Lock()
		defer s.h.mu.Unlock()
		p, capacity, err := s.h.newVolumeLocked(Pool, &def, perr)
		if err != nil {
			return err
		}
		src, err := s.h.volLocked(Clonevol)
		if err != nil {
			return err
		}
		data := slices.Clone(src.data)
		if probedFormat(src) != "raw" || formatOf(def) != "raw" {
			data = append(data, make([]byte, 64<<10)...) // qemu-img convert: other bytes
		}
		if uint64(len(data)) > p.available() {
			return Errorf(libvirt.ErrSystemError, "cannot write data to file '%s': No space left on device", path.Join(p.target, def.Name))
		}
		v := &volume{def: def, path: path.Join(p.target, def.Name), capacity: max(capacity, src.capacity), data: data}
		p.vols[def.Name] = v
		rVol = p.volHandle(v)
		return nil
	})
	return rVol, err
}

// probedFormat is the format libvirt sees in a dir pool's volume: qcow2
// when its bytes start with the qcow2 magic, else its definition's.
func probedFormat(v *volume) string {
	if strings.HasPrefix(string(v.data[:min(len(v.data), 4)]), "QFI\xfb") {
		return "qcow2"
	}
	return formatOf(v.def)
}

// formatOf is a volume definition's target format, "raw" when it has none.
func formatOf(def libvirtxml.StorageVolume) string {
	if t := def.Target; t != nil && t.Format != nil && t.Format.Type != "" {
		return t.Format.Type
	}
	return "raw"
}

// StorageVolDelete deletes a volume.
func (s *Session) StorageVolDelete(Vol libvirt.StorageVol, Flags libvirt.StorageVolDeleteFlags) (err error) {
	return s.run(Call{Method: "StorageVolDelete", Pool: Vol.Pool, Volume: Vol.Name}, func() error {
		s.h.mu.Lock()
		defer s.h.mu.Unlock()
		if _, err := s.h.volLocked(Vol); err != nil {
			return err
		}
		delete(s.h.pools[Vol.Pool].vols, Vol.Name)
		return nil
	})
}

// StorageVolGetPath is the volume's file path, "<pool target>/<name>".
func (s *Session) StorageVolGetPath(Vol libvirt.StorageVol) (rName string, err error) {
	err = s.run(Call{Method: "StorageVolGetPath", Pool: Vol.Pool, Volume: Vol.Name}, func() error {
		s.h.mu.Lock()
		defer s.h.mu.Unlock()
		v, err := s.h.volLocked(Vol)
		if err != nil {
			return err
		}
		rName = v.path
		return nil
	})
	return rName, err
}

// StorageVolGetXMLDesc is the volume's XML: as created, with key, target
// path, format ("raw" when none was given) and sizes filled in.
func (s *Session) StorageVolGetXMLDesc(Vol libvirt.StorageVol, Flags uint32) (rXML string, err error) {
	err = s.run(Call{Method: "StorageVolGetXMLDesc", Pool: Vol.Pool, Volume: Vol.Name}, func() error {
		s.h.mu.Lock()
		defer s.h.mu.Unlock()
		v, err := s.h.volLocked(Vol)
		if err != nil {
			return err
		}
		x := v.def
		x.Type = "file"
		x.Key = v.path
		x.Capacity = &libvirtxml.StorageVolumeSize{Unit: "bytes", Value: max(v.capacity, uint64(len(v.data)))}
		x.Allocation = &libvirtxml.StorageVolumeSize{Unit: "bytes", Value: uint64(len(v.data))}
		x.Physical = &libvirtxml.StorageVolumeSize{Unit: "bytes", Value: uint64(len(v.data))}
		t := libvirtxml.StorageVolumeTarget{}
		if x.Target != nil {
			t = *x.Target
		}
		t.Path = v.path
		if t.Format == nil {
			t.Format = &libvirtxml.StorageVolumeTargetFormat{Type: "raw"}
		}
		x.Target = &t
		rXML, err = x.Marshal()
		return err
	})
	return rXML, err
}

// StorageVolGetInfo returns the file type, the capacity and the
// allocation (the length of the data).
func (s *Session) StorageVolGetInfo(Vol libvirt.StorageVol) (rType int8, rCapacity uint64, rAllocation uint64, err error) {
	err = s.run(Call{Method: "StorageVolGetInfo", Pool: Vol.Pool, Volume: Vol.Name}, func() error {
		rType, rCapacity, rAllocation, err = s.h.volInfo(Vol)
		return err
	})
	return rType, rCapacity, rAllocation, err
}

// StorageVolGetInfoFlags is StorageVolGetInfo (with StorageVolGetPhysical
// the physical size, which is the length of the data too).
func (s *Session) StorageVolGetInfoFlags(Vol libvirt.StorageVol, Flags uint32) (rType int8, rCapacity uint64, rAllocation uint64, err error) {
	err = s.run(Call{Method: "StorageVolGetInfoFlags", Pool: Vol.Pool, Volume: Vol.Name}, func() error {
		rType, rCapacity, rAllocation, err = s.h.volInfo(Vol)
		return err
	})
	return rType, rCapacity, rAllocation, err
}

func (h *Host) volInfo(Vol libvirt.StorageVol) (int8, uint64, uint64, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	v, err := h.volLocked(Vol)
	if err != nil {
		return 0, 0, 0, err
	}
	n := uint64(len(v.data))
	return int8(libvirt.StorageVolFile), max(v.capacity, n), n, nil
}

// StorageVolUpload writes outStream into the volume from Offset (Length
// 0: to the end of the stream; a Length beyond the volume's capacity is
// refused), one chunk at a time: each chunk is read from outStream, then
// stored, so a reader that asks for the volume's size sees every byte of
// the chunks before. Before each chunk the stream hook runs. Writing
// beyond the pool's free space fails as a full disk does. A volume
// deleted meanwhile takes the bytes silently, as an unlinked file does.
// Kill ends the call between chunks (a Read of outStream that blocks is
// waited for, as go-libvirt does).
func (s *Session) StorageVolUpload(Vol libvirt.StorageVol, outStream io.Reader, Offset uint64, Length uint64, Flags libvirt.StorageVolUploadFlags) (err error) {
	return s.run(Call{Method: "StorageVolUpload", Pool: Vol.Pool, Volume: Vol.Name}, func() error {
		return s.upload(Call{Method: "StorageVolUpload", Session: s, Pool: Vol.Pool, Volume: Vol.Name}, outStream, Offset, Length)
	})
}

func (s *Session) upload(c Call, src io.Reader, offset, length uint64) error {
	s.h.mu.Lock()
	v, err := s.h.volLocked(libvirt.StorageVol{Pool: c.Pool, Name: c.Volume})
	if err == nil && length > 0 && offset+length > max(v.capacity, uint64(len(v.data))) {
		err = Errorf(libvirt.ErrInvalidArg, "invalid argument: range to upload exceeds volume size")
	}
	p := s.h.pools[c.Pool]
	chunk := s.h.chunk
	s.h.mu.Unlock()
	if err != nil {
		return err
	}
	buf := make([]byte, chunk)
	off := offset
	for {
		if err := s.h.streamHook(c); err != nil {
			return err
		}
		want := buf
		if length > 0 {
			left := length - uint64(c.Done)
			if left == 0 {
				return nil
			}
			want = buf[:min(uint64(len(buf)), left)]
		}
		n, rerr := src.Read(want)
		if s.isDead() {
			return ErrKilled
		}
		if n > 0 {
			if err := s.h.write(p, v, off, want[:n]); err != nil {
				return err
			}
			off += uint64(n)
			c.Done += int64(n)
		}
		if rerr == io.EOF {
			return nil
		}
		if rerr != nil {
			// go-libvirt aborts the stream and returns the reader's error.
			return rerr
		}
	}
}

func (h *Host) write(p *pool, v *volume, off uint64, b []byte) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	end := off + uint64(len(b))
	if grow := end - min(end, uint64(len(v.data))); grow > 0 && h.pools[p.name] == p && p.vols[v.def.Name] == v && grow > p.available() {
		return Errorf(libvirt.ErrSystemError, "cannot write data to file '%s': No space left on device", v.path)
	}
	if end > uint64(len(v.data)) {
		v.data = append(v.data, make([]byte, end-uint64(len(v.data)))...)
	}
	copy(v.data[off:], b)
	return nil
}

// StorageVolDownload writes the volume's bytes from Offset (Length 0: to
// the end) to inStream, one chunk at a time, running the stream hook
// before each. A write error ends the call with it. Kill ends the call
// between chunks.
func (s *Session) StorageVolDownload(Vol libvirt.StorageVol, inStream io.Writer, Offset uint64, Length uint64, Flags libvirt.StorageVolDownloadFlags) (err error) {
	return s.run(Call{Method: "StorageVolDownload", Pool: Vol.Pool, Volume: Vol.Name}, func() error {
		return s.download(Call{Method: "StorageVolDownload", Session: s, Pool: Vol.Pool, Volume: Vol.Name}, inStream, Offset, Length)
	})
}

func (s *Session) download(c Call, dst io.Writer, offset, length uint64) error {
	s.h.mu.Lock()
	v, err := s.h.volLocked(libvirt.StorageVol{Pool: c.Pool, Name: c.Volume})
	chunk := s.h.chunk
	s.h.mu.Unlock()
	if err != nil {
		return err
	}
	off := offset
	for {
		if err := s.h.streamHook(c); err != nil {
			return err
		}
		s.h.mu.Lock()
		end := uint64(len(v.data))
		if length > 0 {
			end = min(end, offset+length)
		}
		var b []byte
		if off < end {
			b = slices.Clone(v.data[off:min(end, off+uint64(chunk))])
		}
		s.h.mu.Unlock()
		if len(b) == 0 {
			return nil
		}
		if _, err := dst.Write(b); err != nil {
			return err
		}
		off += uint64(len(b))
		c.Done += int64(len(b))
	}
}

// size converts a libvirt size with its unit to bytes (nil: 0).
func size(s *libvirtxml.StorageVolumeSize) (uint64, error) {
	if s == nil {
		return 0, nil
	}
	mult := map[string]uint64{
		"": 1, "b": 1, "bytes": 1,
		"k": 1 << 10, "kib": 1 << 10, "kb": 1e3,
		"m": 1 << 20, "mib": 1 << 20, "mb": 1e6,
		"g": 1 << 30, "gib": 1 << 30, "gb": 1e9,
		"t": 1 << 40, "tib": 1 << 40, "tb": 1e12,
	}[strings.ToLower(s.Unit)]
	if mult == 0 {
		return 0, Errorf(libvirt.ErrInvalidArg, "invalid argument: unknown suffix '%s'", s.Unit)
	}
	return s.Value * mult, nil
}
