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
	active   bool
	vols     map[string]*volume
}

// volume is one file volume; data is its content on the "host".
type volume struct {
	def      libvirtxml.StorageVolume // as created (name, target format, backing store)
	path     string
	capacity uint64
	data     []byte
}

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
		return lverr(libvirt.ErrOperationFailed, "operation failed: pool '%s' already exists", name)
	}
	h.pools[name] = &pool{name: name, uuid: h.uuidLocked(), target: "/pools/" + name, capacity: capacity, active: true, vols: map[string]*volume{}}
	return nil
}

// SetPoolActive starts or stops a pool (its volumes are kept).
func (h *Host) SetPoolActive(name string, active bool) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	p, ok := h.pools[name]
	if !ok {
		return errNoPool(name)
	}
	p.active = active
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

// VolumeNames returns the sorted names of the volumes of a pool (nil for
// a pool that does not exist), active or not.
func (h *Host) VolumeNames(pool string) []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	p, ok := h.pools[pool]
	if !ok {
		return nil
	}
	names := make([]string, 0, len(p.vols))
	for n := range p.vols {
		names = append(names, n)
	}
	slices.Sort(names)
	return names
}

// VolumeData returns a copy of a volume's bytes.
func (h *Host) VolumeData(pool, name string) ([]byte, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	p, ok := h.pools[pool]
	if !ok {
		return nil, false
	}
	v, ok := p.vols[name]
	if !ok {
		return nil, false
	}
	return slices.Clone(v.data), true
}

// PutVolume creates (or replaces) a volume holding data, bypassing hooks
// and checks: test setup.
func (h *Host) PutVolume(pool, name string, data []byte) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	p, ok := h.pools[pool]
	if !ok {
		return errNoPool(pool)
	}
	p.vols[name] = &volume{def: libvirtxml.StorageVolume{Name: name}, path: path.Join(p.target, name), capacity: uint64(len(data)), data: slices.Clone(data)}
	return nil
}

// SetVolumeData replaces a volume's bytes (to corrupt what was stored).
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

func errNoPool(name string) error {
	return lverr(libvirt.ErrNoStoragePool, "Storage pool not found: no storage pool with matching name '%s'", name)
}

func errNoVol(name string) error {
	return lverr(libvirt.ErrNoStorageVol, "Storage volume not found: no storage vol with matching name '%s'", name)
}

func errInactive(name string) error {
	return lverr(libvirt.ErrOperationInvalid, "Requested operation is not valid: storage pool '%s' is not active", name)
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
		return nil, lverr(libvirt.ErrNoStoragePool, "Storage pool not found: no storage pool with matching uuid '%s' (%s)", uuidString(hd.UUID), hd.Name)
	}
	return p, nil
}

func (h *Host) activePoolByHandleLocked(hd libvirt.StoragePool) (*pool, error) {
	p, err := h.poolByHandleLocked(hd)
	if err != nil {
		return nil, err
	}
	if !p.active {
		return nil, errInactive(hd.Name)
	}
	return p, nil
}

func (h *Host) activePoolLocked(name string) (*pool, error) {
	p, err := h.poolLocked(name)
	if err != nil {
		return nil, err
	}
	if !p.active {
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

func (p *pool) handle() libvirt.StoragePool { return libvirt.StoragePool{Name: p.name, UUID: p.uuid} }

func (p *pool) volHandle(v *volume) libvirt.StorageVol {
	return libvirt.StorageVol{Pool: p.name, Name: v.def.Name, Key: v.path}
}

// ConnectListAllStoragePools lists the pools, sorted by name; flags
// ConnectListStoragePoolsActive/Inactive filter (none: all).
func (s *Session) ConnectListAllStoragePools(NeedResults int32, Flags libvirt.ConnectListAllStoragePoolsFlags) (rPools []libvirt.StoragePool, rRet uint32, err error) {
	if err := s.h.enter(Call{Method: "ConnectListAllStoragePools", Session: s}); err != nil {
		return nil, 0, err
	}
	s.h.mu.Lock()
	defer s.h.mu.Unlock()
	wantActive := Flags&libvirt.ConnectListStoragePoolsActive != 0
	wantInactive := Flags&libvirt.ConnectListStoragePoolsInactive != 0
	for _, name := range sortedKeys(s.h.pools) {
		p := s.h.pools[name]
		if (wantActive || wantInactive) && !(wantActive && p.active || wantInactive && !p.active) {
			continue
		}
		rPools = append(rPools, p.handle())
	}
	return rPools, uint32(len(rPools)), nil
}

// StoragePoolLookupByName finds a pool, active or not.
func (s *Session) StoragePoolLookupByName(Name string) (rPool libvirt.StoragePool, err error) {
	if err := s.h.enter(Call{Method: "StoragePoolLookupByName", Session: s, Pool: Name}); err != nil {
		return libvirt.StoragePool{}, err
	}
	s.h.mu.Lock()
	defer s.h.mu.Unlock()
	p, err := s.h.poolLocked(Name)
	if err != nil {
		return libvirt.StoragePool{}, err
	}
	return p.handle(), nil
}

// StoragePoolIsActive is 1 for a running pool, 0 for a stopped one.
func (s *Session) StoragePoolIsActive(Pool libvirt.StoragePool) (rActive int32, err error) {
	if err := s.h.enter(Call{Method: "StoragePoolIsActive", Session: s, Pool: Pool.Name}); err != nil {
		return 0, err
	}
	s.h.mu.Lock()
	defer s.h.mu.Unlock()
	p, err := s.h.poolByHandleLocked(Pool)
	if err != nil {
		return 0, err
	}
	if p.active {
		return 1, nil
	}
	return 0, nil
}

// StoragePoolGetXMLDesc is the pool's XML (type dir, target path, sizes).
func (s *Session) StoragePoolGetXMLDesc(Pool libvirt.StoragePool, Flags libvirt.StorageXMLFlags) (rXML string, err error) {
	if err := s.h.enter(Call{Method: "StoragePoolGetXMLDesc", Session: s, Pool: Pool.Name}); err != nil {
		return "", err
	}
	s.h.mu.Lock()
	defer s.h.mu.Unlock()
	p, err := s.h.poolByHandleLocked(Pool)
	if err != nil {
		return "", err
	}
	x := libvirtxml.StoragePool{
		Type: "dir", Name: p.name, UUID: uuidString(p.uuid),
		Capacity:   &libvirtxml.StoragePoolSize{Unit: "bytes", Value: p.capacity},
		Allocation: &libvirtxml.StoragePoolSize{Unit: "bytes", Value: p.allocation()},
		Available:  &libvirtxml.StoragePoolSize{Unit: "bytes", Value: p.available()},
		Target:     &libvirtxml.StoragePoolTarget{Path: p.target},
	}
	return x.Marshal()
}

// StoragePoolGetInfo returns the state and sizes (all zero for a stopped
// pool, as libvirtd reports them).
func (s *Session) StoragePoolGetInfo(Pool libvirt.StoragePool) (rState uint8, rCapacity uint64, rAllocation uint64, rAvailable uint64, err error) {
	if err := s.h.enter(Call{Method: "StoragePoolGetInfo", Session: s, Pool: Pool.Name}); err != nil {
		return 0, 0, 0, 0, err
	}
	s.h.mu.Lock()
	defer s.h.mu.Unlock()
	p, err := s.h.poolByHandleLocked(Pool)
	if err != nil {
		return 0, 0, 0, 0, err
	}
	if !p.active {
		return uint8(libvirt.StoragePoolInactive), 0, 0, 0, nil
	}
	return uint8(libvirt.StoragePoolRunning), p.capacity, p.allocation(), p.available(), nil
}

// StoragePoolRefresh does nothing on a running pool.
func (s *Session) StoragePoolRefresh(Pool libvirt.StoragePool, Flags uint32) (err error) {
	if err := s.h.enter(Call{Method: "StoragePoolRefresh", Session: s, Pool: Pool.Name}); err != nil {
		return err
	}
	s.h.mu.Lock()
	defer s.h.mu.Unlock()
	_, err = s.h.activePoolByHandleLocked(Pool)
	return err
}

// StoragePoolListAllVolumes lists a running pool's volumes, sorted by name.
func (s *Session) StoragePoolListAllVolumes(Pool libvirt.StoragePool, NeedResults int32, Flags uint32) (rVols []libvirt.StorageVol, rRet uint32, err error) {
	if err := s.h.enter(Call{Method: "StoragePoolListAllVolumes", Session: s, Pool: Pool.Name}); err != nil {
		return nil, 0, err
	}
	s.h.mu.Lock()
	defer s.h.mu.Unlock()
	p, err := s.h.activePoolByHandleLocked(Pool)
	if err != nil {
		return nil, 0, err
	}
	for _, n := range sortedKeys(p.vols) {
		rVols = append(rVols, p.volHandle(p.vols[n]))
	}
	return rVols, uint32(len(rVols)), nil
}

// StorageVolLookupByName finds a volume of a running pool.
func (s *Session) StorageVolLookupByName(Pool libvirt.StoragePool, Name string) (rVol libvirt.StorageVol, err error) {
	if err := s.h.enter(Call{Method: "StorageVolLookupByName", Session: s, Pool: Pool.Name, Volume: Name}); err != nil {
		return libvirt.StorageVol{}, err
	}
	s.h.mu.Lock()
	defer s.h.mu.Unlock()
	p, err := s.h.activePoolByHandleLocked(Pool)
	if err != nil {
		return libvirt.StorageVol{}, err
	}
	v, ok := p.vols[Name]
	if !ok {
		return libvirt.StorageVol{}, errNoVol(Name)
	}
	return p.volHandle(v), nil
}

// StorageVolCreateXML creates an empty file volume from its XML (name
// required; capacity in any libvirt unit; target format and backing store
// kept for StorageVolGetXMLDesc). The name is taken atomically: an
// existing name fails with ErrStorageVolExist.
func (s *Session) StorageVolCreateXML(Pool libvirt.StoragePool, XML string, Flags libvirt.StorageVolCreateFlags) (rVol libvirt.StorageVol, err error) {
	var def libvirtxml.StorageVolume
	perr := def.Unmarshal(XML)
	if err := s.h.enter(Call{Method: "StorageVolCreateXML", Session: s, Pool: Pool.Name, Volume: def.Name}); err != nil {
		return libvirt.StorageVol{}, err
	}
	if perr != nil {
		return libvirt.StorageVol{}, lverr(libvirt.ErrXMLError, "XML error: %v", perr)
	}
	if def.Name == "" {
		return libvirt.StorageVol{}, lverr(libvirt.ErrXMLError, "XML error: missing volume name element")
	}
	capacity, err := size(def.Capacity)
	if err != nil {
		return libvirt.StorageVol{}, err
	}
	s.h.mu.Lock()
	defer s.h.mu.Unlock()
	p, err := s.h.activePoolByHandleLocked(Pool)
	if err != nil {
		return libvirt.StorageVol{}, err
	}
	if _, ok := p.vols[def.Name]; ok {
		return libvirt.StorageVol{}, lverr(libvirt.ErrStorageVolExist, "storage volume '%s' exists already", def.Name)
	}
	v := &volume{def: def, path: path.Join(p.target, def.Name), capacity: capacity}
	p.vols[def.Name] = v
	return p.volHandle(v), nil
}

// StorageVolDelete deletes a volume.
func (s *Session) StorageVolDelete(Vol libvirt.StorageVol, Flags libvirt.StorageVolDeleteFlags) (err error) {
	if err := s.h.enter(Call{Method: "StorageVolDelete", Session: s, Pool: Vol.Pool, Volume: Vol.Name}); err != nil {
		return err
	}
	s.h.mu.Lock()
	defer s.h.mu.Unlock()
	if _, err := s.h.volLocked(Vol); err != nil {
		return err
	}
	delete(s.h.pools[Vol.Pool].vols, Vol.Name)
	return nil
}

// StorageVolGetPath is the volume's file path, "<pool target>/<name>".
func (s *Session) StorageVolGetPath(Vol libvirt.StorageVol) (rName string, err error) {
	if err := s.h.enter(Call{Method: "StorageVolGetPath", Session: s, Pool: Vol.Pool, Volume: Vol.Name}); err != nil {
		return "", err
	}
	s.h.mu.Lock()
	defer s.h.mu.Unlock()
	v, err := s.h.volLocked(Vol)
	if err != nil {
		return "", err
	}
	return v.path, nil
}

// StorageVolGetXMLDesc is the volume's XML: as created, with key, target
// path and sizes filled in.
func (s *Session) StorageVolGetXMLDesc(Vol libvirt.StorageVol, Flags uint32) (rXML string, err error) {
	if err := s.h.enter(Call{Method: "StorageVolGetXMLDesc", Session: s, Pool: Vol.Pool, Volume: Vol.Name}); err != nil {
		return "", err
	}
	s.h.mu.Lock()
	defer s.h.mu.Unlock()
	v, err := s.h.volLocked(Vol)
	if err != nil {
		return "", err
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
	return x.Marshal()
}

// StorageVolGetInfoFlags returns the file type, the capacity and the
// allocation (with StorageVolGetPhysical: the physical size; both are the
// length of the data here).
func (s *Session) StorageVolGetInfoFlags(Vol libvirt.StorageVol, Flags uint32) (rType int8, rCapacity uint64, rAllocation uint64, err error) {
	if err := s.h.enter(Call{Method: "StorageVolGetInfoFlags", Session: s, Pool: Vol.Pool, Volume: Vol.Name}); err != nil {
		return 0, 0, 0, err
	}
	s.h.mu.Lock()
	defer s.h.mu.Unlock()
	v, err := s.h.volLocked(Vol)
	if err != nil {
		return 0, 0, 0, err
	}
	n := uint64(len(v.data))
	return int8(libvirt.StorageVolFile), max(v.capacity, n), n, nil
}

// StorageVolUpload writes outStream into the volume from Offset (Length
// 0: to the end of the stream), one chunk at a time: each chunk is read
// from outStream, then stored, so a reader that asks for the volume's size
// sees every byte of the chunks before. Before each chunk the stream hook
// runs. Writing beyond the pool's free space fails as a full disk does. A
// volume deleted meanwhile takes the bytes silently, as an unlinked file
// does. Kill ends the call between chunks (a Read of outStream that
// blocks is waited for, as go-libvirt does).
func (s *Session) StorageVolUpload(Vol libvirt.StorageVol, outStream io.Reader, Offset uint64, Length uint64, Flags libvirt.StorageVolUploadFlags) (err error) {
	c := Call{Method: "StorageVolUpload", Session: s, Pool: Vol.Pool, Volume: Vol.Name}
	if err := s.h.enter(c); err != nil {
		return err
	}
	s.h.mu.Lock()
	v, err := s.h.volLocked(Vol)
	p := s.h.pools[Vol.Pool]
	chunk := s.h.chunk
	s.h.mu.Unlock()
	if err != nil {
		return err
	}
	buf := make([]byte, chunk)
	off := Offset
	for {
		if err := s.h.streamHook(c); err != nil {
			return err
		}
		want := buf
		if Length > 0 {
			left := Length - uint64(c.Done)
			if left == 0 {
				return nil
			}
			want = buf[:min(uint64(len(buf)), left)]
		}
		n, rerr := outStream.Read(want)
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
		return lverr(libvirt.ErrSystemError, "cannot write data to file '%s': No space left on device", v.path)
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
	c := Call{Method: "StorageVolDownload", Session: s, Pool: Vol.Pool, Volume: Vol.Name}
	if err := s.h.enter(c); err != nil {
		return err
	}
	s.h.mu.Lock()
	v, err := s.h.volLocked(Vol)
	chunk := s.h.chunk
	s.h.mu.Unlock()
	if err != nil {
		return err
	}
	off := Offset
	for {
		if err := s.h.streamHook(c); err != nil {
			return err
		}
		s.h.mu.Lock()
		end := uint64(len(v.data))
		if Length > 0 {
			end = min(end, Offset+Length)
		}
		var b []byte
		if off < end {
			b = slices.Clone(v.data[off:min(end, off+uint64(chunk))])
		}
		s.h.mu.Unlock()
		if len(b) == 0 {
			return nil
		}
		if _, err := inStream.Write(b); err != nil {
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
		return 0, lverr(libvirt.ErrInvalidArg, "invalid argument: unknown suffix '%s'", s.Unit)
	}
	return s.Value * mult, nil
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}
