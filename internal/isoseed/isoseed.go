package isoseed

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sort"
	"strings"
	"time"
)

// SectorSize is the logical block size of the images written here.
const SectorSize = 2048

// Limits of the images written here.
const (
	MaxLabelLen = 32       // ECMA-119 8.4.6: the Volume Identifier field
	MaxNameLen  = 30       // ECMA-119 7.5.1: file name and extension together
	MaxFileSize = 16 << 20 // far above any seed; keeps an image small
)

// firstDataSector is the first sector of file data (see the package doc).
const (
	pvdSector        = 16
	terminatorSector = 17
	lPathSector      = 18
	mPathSector      = 19
	rootSector       = 20
	ceSector         = 21
	firstDataSector  = 22
)

// Rock Ridge extension reference (RRIP 1.12 section 4.3, SUSP 5.5).
const (
	rrID     = "RRIP_1991A"
	rrDesc   = "THE ROCK RIDGE INTERCHANGE PROTOCOL PROVIDES SUPPORT FOR POSIX FILE SYSTEM SEMANTICS"
	rrSource = "PLEASE CONTACT DISC PUBLISHER FOR SPECIFICATION SOURCE.  SEE PUBLISHER IDENTIFIER IN PRIMARY VOLUME DESCRIPTOR FOR CONTACT INFORMATION."
)

// POSIX modes recorded in PX entries.
const (
	modeDir  = 0o040555
	modeFile = 0o100444
)

// File is one file of the root directory.
type File struct {
	Name string // 1-30 of a-z 0-9 _ - and at most one "." (not first or last)
	Data []byte
}

// Volume describes an image.
type Volume struct {
	Label string    // 1-32 of A-Z a-z 0-9 _ (cloud-init's NoCloud looks for "cidata")
	Files []File    // distinct names; order does not matter
	Time  time.Time // recording time of the volume and its files; zero: not specified
}

// ErrInvalid is wrapped by every error Build returns: all of them are about
// its input.
var ErrInvalid = errors.New("isoseed: invalid volume")

func invalid(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrInvalid, fmt.Sprintf(format, args...))
}

// Size returns the size in bytes of the image Build writes for files of
// these sizes: 22 sectors of metadata plus each file rounded up to whole
// sectors.
func Size(fileSizes ...int) int64 {
	n := int64(firstDataSector)
	for _, s := range fileSizes {
		n += sectors(s)
	}
	return n * SectorSize
}

func sectors(n int) int64 { return (int64(n) + SectorSize - 1) / SectorSize }

// Build returns the image of v. Errors wrap ErrInvalid and name the label or
// file at fault (never a file's content).
func Build(v Volume) ([]byte, error) {
	if err := checkLabel(v.Label); err != nil {
		return nil, err
	}
	files := make([]File, len(v.Files))
	copy(files, v.Files)
	seen := make(map[string]bool, len(files))
	sizes := make([]int, len(files))
	for i, f := range files {
		if err := checkName(f.Name); err != nil {
			return nil, err
		}
		if seen[f.Name] {
			return nil, invalid("file name %q appears twice", f.Name)
		}
		seen[f.Name] = true
		if len(f.Data) > MaxFileSize {
			return nil, invalid("file %q is %d bytes, at most %d allowed", f.Name, len(f.Data), MaxFileSize)
		}
		sizes[i] = len(f.Data)
	}
	// ECMA-119 9.3: records in order of their file identifiers.
	sort.Slice(files, func(i, j int) bool { return isoIdentifier(files[i].Name) < isoIdentifier(files[j].Name) })

	img := make([]byte, Size(sizes...))
	total := uint32(len(img) / SectorSize)
	stamp := dirDate(v.Time)

	// Files' data, and their directory records.
	rootDir := make([]byte, 0, SectorSize)
	rootDir = append(rootDir, dirRecord(rootSector, SectorSize, stamp, true, []byte{0},
		concat(spEntry(), ceEntry(ceSector, 0, len(erEntry())), pxEntry(modeDir, 2, 1)))...)
	rootDir = append(rootDir, dirRecord(rootSector, SectorSize, stamp, true, []byte{1},
		pxEntry(modeDir, 2, 1))...)
	next := uint32(firstDataSector)
	for i, f := range files {
		loc := next
		if len(f.Data) == 0 {
			loc = 0 // no extent
		}
		copy(img[int64(next)*SectorSize:], f.Data)
		next += uint32(sectors(len(f.Data)))
		rec := dirRecord(loc, uint32(len(f.Data)), stamp, false, []byte(isoIdentifier(f.Name)),
			concat(pxEntry(modeFile, 1, uint32(i+2)), nmEntry(f.Name)))
		rootDir = append(rootDir, rec...)
	}
	if len(rootDir) > SectorSize {
		return nil, invalid("%d files do not fit one directory sector", len(files))
	}
	copy(img[rootSector*SectorSize:], rootDir)
	copy(img[ceSector*SectorSize:], erEntry())

	// Path tables (ECMA-119 9.4): the root only.
	copy(img[lPathSector*SectorSize:], pathTable(rootSector, binary.LittleEndian))
	copy(img[mPathSector*SectorSize:], pathTable(rootSector, binary.BigEndian))

	// Volume descriptors.
	pvd := img[pvdSector*SectorSize : (pvdSector+1)*SectorSize]
	pvd[0] = 1
	copy(pvd[1:6], "CD001")
	pvd[6] = 1
	fill(pvd[8:40], "")       // system identifier
	fill(pvd[40:72], v.Label) // volume identifier
	both32(pvd[80:88], total) // volume space size
	both16(pvd[120:124], 1)   // volume set size
	both16(pvd[124:128], 1)   // volume sequence number
	both16(pvd[128:132], SectorSize)
	both32(pvd[132:140], uint32(len(pathTable(rootSector, binary.LittleEndian))))
	binary.LittleEndian.PutUint32(pvd[140:144], lPathSector)
	binary.BigEndian.PutUint32(pvd[148:152], mPathSector)
	copy(pvd[156:190], dirRecord(rootSector, SectorSize, stamp, true, []byte{0}, nil))
	fill(pvd[190:318], "")              // volume set identifier
	fill(pvd[318:446], "")              // publisher
	fill(pvd[446:574], "")              // data preparer
	fill(pvd[574:702], "")              // application
	fill(pvd[702:739], "")              // copyright file
	fill(pvd[739:776], "")              // abstract file
	fill(pvd[776:813], "")              // bibliographic file
	copy(pvd[813:830], volDate(v.Time)) // creation
	copy(pvd[830:847], volDate(v.Time)) // modification
	copy(pvd[847:864], volDate(time.Time{}))
	copy(pvd[864:881], volDate(time.Time{}))
	pvd[881] = 1 // file structure version

	term := img[terminatorSector*SectorSize : (terminatorSector+1)*SectorSize]
	term[0] = 255
	copy(term[1:6], "CD001")
	term[6] = 1
	return img, nil
}

func checkLabel(l string) error {
	if l == "" || len(l) > MaxLabelLen {
		return invalid("label must be 1-%d characters, is %d", MaxLabelLen, len(l))
	}
	for i := 0; i < len(l); i++ {
		c := l[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_') {
			return invalid("label %q: only A-Z a-z 0-9 _ allowed", l)
		}
	}
	return nil
}

func checkName(n string) error {
	if n == "" || len(n) > MaxNameLen {
		return invalid("file name must be 1-%d characters, is %d", MaxNameLen, len(n))
	}
	for i := 0; i < len(n); i++ {
		c := n[i]
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '_' || c == '-' || c == '.') {
			return invalid("file name %q: only a-z 0-9 _ - . allowed", n)
		}
	}
	if strings.Count(n, ".") > 1 || n[0] == '.' || n[len(n)-1] == '.' {
		return invalid("file name %q: at most one \".\", not first or last", n)
	}
	return nil
}

// isoIdentifier is the ECMA-119 file identifier of a checked name.
func isoIdentifier(name string) string {
	if !strings.Contains(name, ".") {
		name += "."
	}
	return name + ";1"
}

// dirRecord is an ECMA-119 9.1 directory record.
func dirRecord(extent, length uint32, stamp [7]byte, dir bool, id, systemUse []byte) []byte {
	n := 33 + len(id)
	if len(id)%2 == 0 {
		n++ // padding field
	}
	n += len(systemUse)
	if n%2 == 1 {
		n++ // records have even length; a trailing 0 is no SUSP entry
	}
	r := make([]byte, n)
	r[0] = byte(n)
	both32(r[2:10], extent)
	both32(r[10:18], length)
	copy(r[18:25], stamp[:])
	if dir {
		r[25] = 2
	}
	both16(r[28:32], 1)
	r[32] = byte(len(id))
	copy(r[33:], id)
	su := 33 + len(id)
	if len(id)%2 == 0 {
		su++
	}
	copy(r[su:], systemUse)
	return r
}

// pathTable is a path table with the root directory alone.
func pathTable(rootExtent uint32, order binary.ByteOrder) []byte {
	t := make([]byte, 10)
	t[0] = 1 // length of the identifier
	order.PutUint32(t[2:6], rootExtent)
	order.PutUint16(t[6:8], 1) // parent: itself
	return t                   // t[8] identifier 0, t[9] padding
}

// SUSP entries (SUSP 1.12 section 5) and Rock Ridge entries (RRIP 1.12
// section 4.1).

func spEntry() []byte { return []byte{'S', 'P', 7, 1, 0xBE, 0xEF, 0} }

func ceEntry(sector, offset uint32, length int) []byte {
	e := make([]byte, 28)
	copy(e, "CE")
	e[2], e[3] = 28, 1
	both32(e[4:12], sector)
	both32(e[12:20], offset)
	both32(e[20:28], uint32(length))
	return e
}

func erEntry() []byte {
	e := []byte{'E', 'R', byte(8 + len(rrID) + len(rrDesc) + len(rrSource)), 1,
		byte(len(rrID)), byte(len(rrDesc)), byte(len(rrSource)), 1}
	return concat(e, []byte(rrID), []byte(rrDesc), []byte(rrSource))
}

func pxEntry(mode, links, serial uint32) []byte {
	e := make([]byte, 44)
	copy(e, "PX")
	e[2], e[3] = 44, 1
	both32(e[4:12], mode)
	both32(e[12:20], links)
	// uid and gid 0
	both32(e[36:44], serial)
	return e
}

func nmEntry(name string) []byte {
	return concat([]byte{'N', 'M', byte(5 + len(name)), 1, 0}, []byte(name))
}

func concat(parts ...[]byte) []byte {
	var out []byte
	for _, p := range parts {
		out = append(out, p...)
	}
	return out
}

// both16 and both32 write ECMA-119 7.2.3 / 7.3.3 both-byte-order numbers.
func both16(b []byte, v uint16) {
	binary.LittleEndian.PutUint16(b[0:2], v)
	binary.BigEndian.PutUint16(b[2:4], v)
}

func both32(b []byte, v uint32) {
	binary.LittleEndian.PutUint32(b[0:4], v)
	binary.BigEndian.PutUint32(b[4:8], v)
}

// fill writes s padded with spaces (ECMA-119 a- and d-character fields).
func fill(b []byte, s string) {
	n := copy(b, s)
	for i := n; i < len(b); i++ {
		b[i] = ' '
	}
}

// dirDate is an ECMA-119 9.1.5 recording date (UTC), all zero when t is.
func dirDate(t time.Time) [7]byte {
	var d [7]byte
	if t.IsZero() {
		return d
	}
	t = t.UTC()
	y := t.Year() - 1900
	if y < 0 || y > 255 {
		return d
	}
	d = [7]byte{byte(y), byte(t.Month()), byte(t.Day()), byte(t.Hour()), byte(t.Minute()), byte(t.Second()), 0}
	return d
}

// volDate is an ECMA-119 8.4.26.1 date (UTC): 16 digits and an offset,
// all "0" and 0 when t is zero ("not specified").
func volDate(t time.Time) []byte {
	if t.IsZero() || t.UTC().Year() > 9999 || t.UTC().Year() < 1 {
		return append([]byte(strings.Repeat("0", 16)), 0)
	}
	t = t.UTC()
	s := fmt.Sprintf("%04d%02d%02d%02d%02d%02d%02d", t.Year(), t.Month(), t.Day(), t.Hour(), t.Minute(), t.Second(), t.Nanosecond()/1e7)
	return append([]byte(s), 0)
}
