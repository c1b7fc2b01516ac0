package isoseed

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/kdomanski/iso9660"
)

// readBack opens img with an independent ISO 9660 reader (kdomanski/iso9660,
// which honours Rock Ridge names and modes) and returns its label and files.
func readBack(t testing.TB, img []byte) (string, map[string]string) {
	t.Helper()
	r, err := iso9660.OpenImage(bytes.NewReader(img))
	if err != nil {
		t.Fatalf("open image: %v", err)
	}
	label, err := r.Label()
	if err != nil {
		t.Fatalf("label: %v", err)
	}
	root, err := r.RootDir()
	if err != nil {
		t.Fatalf("root: %v", err)
	}
	if !root.IsDir() {
		t.Fatal("root is not a directory")
	}
	kids, err := root.GetChildren()
	if err != nil {
		t.Fatalf("children: %v", err)
	}
	files := map[string]string{}
	for _, k := range kids {
		if k.IsDir() {
			t.Fatalf("%q is a directory", k.Name())
		}
		if k.Mode() != 0o444 {
			t.Errorf("%q: mode %v, want the Rock Ridge mode 0444", k.Name(), k.Mode())
		}
		b, err := io.ReadAll(k.Reader())
		if err != nil {
			t.Fatalf("read %q: %v", k.Name(), err)
		}
		if _, dup := files[k.Name()]; dup {
			t.Fatalf("%q appears twice", k.Name())
		}
		files[k.Name()] = string(b)
	}
	return label, files
}

func seedVolume() Volume {
	return Volume{Label: "cidata", Files: []File{
		{Name: "user-data", Data: []byte("#cloud-config\npackages: [squid]\n")},
		{Name: "meta-data", Data: []byte("instance-id: uid-1\nlocal-hostname: proxy-a\n")},
		{Name: "network-config", Data: []byte("version: 2\n")},
	}}
}

func TestBuildReadBack(t *testing.T) {
	t.Parallel()
	big := bytes.Repeat([]byte("0123456789abcdef"), 64<<10/16+5) // spans many sectors, not a whole number
	tests := []struct {
		name string
		v    Volume
	}{
		{"nocloud", seedVolume()},
		{"two files, one empty", Volume{Label: "cidata", Files: []File{{Name: "meta-data", Data: []byte("x")}, {Name: "user-data"}}}},
		{"no files", Volume{Label: "CIDATA"}},
		{"large and binary", Volume{Label: "cidata", Files: []File{{Name: "user-data", Data: big}, {Name: "b.bin", Data: []byte{0, 0xff, '\n'}}}}},
		{"exactly one sector", Volume{Label: "x", Files: []File{{Name: "a", Data: bytes.Repeat([]byte{7}, SectorSize)}}}},
		{"longest names", Volume{Label: strings.Repeat("L", MaxLabelLen), Files: []File{
			{Name: strings.Repeat("a", MaxNameLen), Data: []byte("1")},
			{Name: strings.Repeat("b", 20) + "." + strings.Repeat("c", 9), Data: []byte("2")},
		}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			img, err := Build(tt.v)
			if err != nil {
				t.Fatal(err)
			}
			label, files := readBack(t, img)
			if label != tt.v.Label {
				t.Errorf("label = %q, want %q", label, tt.v.Label)
			}
			want := map[string]string{}
			var sizes []int
			for _, f := range tt.v.Files {
				want[f.Name] = string(f.Data)
				sizes = append(sizes, len(f.Data))
			}
			if d := cmp.Diff(want, files); d != "" {
				t.Errorf("files (-want +got):\n%s", d)
			}
			if int64(len(img)) != Size(sizes...) {
				t.Errorf("image is %d bytes, Size says %d", len(img), Size(sizes...))
			}
		})
	}
}

// TestVolumeDescriptorBytes checks the descriptors byte by byte against
// ECMA-119 8.4 and 8.3.
func TestVolumeDescriptorBytes(t *testing.T) {
	t.Parallel()
	v := seedVolume()
	v.Time = time.Date(2026, 12, 2, 3, 4, 5, 670_000_000, time.FixedZone("x", 3600))
	img, err := Build(v)
	if err != nil {
		t.Fatal(err)
	}
	if len(img)%SectorSize != 0 {
		t.Fatalf("image is %d bytes, not whole sectors", len(img))
	}
	if !bytes.Equal(img[:16*SectorSize], make([]byte, 16*SectorSize)) {
		t.Error("system area is not zero")
	}
	pvd := img[16*SectorSize : 17*SectorSize]
	check := func(what string, got, want []byte) {
		t.Helper()
		if !bytes.Equal(got, want) {
			t.Errorf("%s = %q, want %q", what, got, want)
		}
	}
	le32 := func(v uint32) []byte { return binary.LittleEndian.AppendUint32(nil, v) }
	be32 := func(v uint32) []byte { return binary.BigEndian.AppendUint32(nil, v) }
	both32 := func(v uint32) []byte { return append(le32(v), be32(v)...) }
	both16 := func(v uint16) []byte {
		return append(binary.LittleEndian.AppendUint16(nil, v), binary.BigEndian.AppendUint16(nil, v)...)
	}
	check("PVD header", pvd[0:7], []byte("\x01CD001\x01"))
	check("system identifier", pvd[8:40], bytes.Repeat([]byte(" "), 32))
	check("volume identifier", pvd[40:72], []byte("cidata"+strings.Repeat(" ", 26)))
	check("volume space size", pvd[80:88], both32(uint32(len(img)/SectorSize)))
	check("volume set size", pvd[120:124], both16(1))
	check("volume sequence number", pvd[124:128], both16(1))
	check("logical block size", pvd[128:132], both16(2048))
	check("path table size", pvd[132:140], both32(10))
	check("L path table", pvd[140:144], le32(18))
	check("M path table", pvd[148:152], be32(19))
	root := pvd[156:190]
	check("root record length", root[0:1], []byte{34})
	check("root extent", root[2:10], both32(20))
	check("root data length", root[10:18], both32(2048))
	check("root recording date", root[18:25], []byte{126, 12, 2, 2, 4, 5, 0})
	check("root flags", root[25:26], []byte{2})
	check("root identifier", root[32:34], []byte{1, 0})
	check("creation date", pvd[813:830], []byte("2026120202040567\x00"))
	check("modification date", pvd[830:847], []byte("2026120202040567\x00"))
	check("expiration date", pvd[847:864], []byte("0000000000000000\x00"))
	check("file structure version", pvd[881:883], []byte{1, 0})
	check("terminator", img[17*SectorSize:17*SectorSize+7], []byte("\xffCD001\x01"))
	check("terminator rest", img[17*SectorSize+7:18*SectorSize], make([]byte, SectorSize-7))
	check("L path table entry", img[18*SectorSize:18*SectorSize+10], []byte{1, 0, 20, 0, 0, 0, 1, 0, 0, 0})
	check("M path table entry", img[19*SectorSize:19*SectorSize+10], []byte{1, 0, 0, 0, 0, 20, 0, 1, 0, 0})
	check("ER entry", img[21*SectorSize:21*SectorSize+18], []byte("ER\xed\x01\x0a\x54\x87\x01RRIP_1991A"))

	// The root directory: ".", "..", then the files sorted by identifier,
	// each with its ISO 9660 identifier lowercase (for readers without Rock
	// Ridge) and its Rock Ridge name.
	dir := img[20*SectorSize : 21*SectorSize]
	var ids []string
	for off := 0; off < len(dir) && dir[off] != 0; off += int(dir[off]) {
		r := dir[off : off+int(dir[off])]
		if len(r)%2 != 0 {
			t.Errorf("record %d has odd length %d", len(ids), len(r))
		}
		ids = append(ids, string(r[33:33+int(r[32])]))
		if len(ids) == 1 {
			check("root . system use starts with SP", r[34:41], []byte("SP\x07\x01\xbe\xef\x00"))
			check("CE entry", r[41:45], []byte("CE\x1c\x01"))
			check("CE location", r[45:53], both32(21))
		}
	}
	want := []string{"\x00", "\x01", "meta-data.;1", "network-config.;1", "user-data.;1"}
	if d := cmp.Diff(want, ids); d != "" {
		t.Errorf("root directory identifiers (-want +got):\n%s", d)
	}
}

func TestDeterministic(t *testing.T) {
	t.Parallel()
	a, err := Build(seedVolume())
	if err != nil {
		t.Fatal(err)
	}
	v := seedVolume()
	v.Files[0], v.Files[2] = v.Files[2], v.Files[0] // order does not matter
	b, err := Build(v)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(a, b) {
		t.Error("equal volumes gave different images")
	}
	// Zero time: every date says "not specified".
	pvd := a[16*SectorSize:]
	if got := string(pvd[813:829]); got != strings.Repeat("0", 16) {
		t.Errorf("creation date %q, want all zero", got)
	}
	if !bytes.Equal(pvd[156+18:156+25], make([]byte, 7)) {
		t.Errorf("root recording date %v, want zero", pvd[156+18:156+25])
	}
}

// TestSizeBound: a NoCloud seed with the largest user-data the provider
// accepts (64 KiB) and a meta-data stays under 44 KiB of overhead plus its
// data rounded to sectors, i.e. under 112 KiB.
func TestSizeBound(t *testing.T) {
	t.Parallel()
	v := Volume{Label: "cidata", Files: []File{
		{Name: "user-data", Data: bytes.Repeat([]byte("x"), 64<<10)},
		{Name: "meta-data", Data: bytes.Repeat([]byte("m"), 300)},
	}}
	img, err := Build(v)
	if err != nil {
		t.Fatal(err)
	}
	if want := int64(22*SectorSize + 64<<10 + SectorSize); int64(len(img)) != want {
		t.Errorf("image is %d bytes, want %d", len(img), want)
	}
	if len(img) > 112<<10 {
		t.Errorf("image is %d bytes, over 112 KiB", len(img))
	}
}

func TestBuildRefuses(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		v    Volume
		want string
	}{
		{"no label", Volume{}, "label must be"},
		{"long label", Volume{Label: strings.Repeat("a", 33)}, "label must be"},
		{"label charset", Volume{Label: "ci data"}, "only A-Z"},
		{"empty name", Volume{Label: "l", Files: []File{{}}}, "file name must be"},
		{"long name", Volume{Label: "l", Files: []File{{Name: strings.Repeat("a", 31)}}}, "file name must be"},
		{"uppercase name", Volume{Label: "l", Files: []File{{Name: "User-Data"}}}, "only a-z"},
		{"slash", Volume{Label: "l", Files: []File{{Name: "a/b"}}}, "only a-z"},
		{"version", Volume{Label: "l", Files: []File{{Name: "a;1"}}}, "only a-z"},
		{"two dots", Volume{Label: "l", Files: []File{{Name: "a.b.c"}}}, "at most one"},
		{"leading dot", Volume{Label: "l", Files: []File{{Name: ".a"}}}, "at most one"},
		{"trailing dot", Volume{Label: "l", Files: []File{{Name: "a."}}}, "at most one"},
		{"duplicate", Volume{Label: "l", Files: []File{{Name: "a"}, {Name: "a"}}}, "twice"},
		{"too large", Volume{Label: "l", Files: []File{{Name: "a", Data: make([]byte, MaxFileSize+1)}}}, "at most"},
		{"too many", Volume{Label: "l", Files: manyFiles(20)}, "do not fit"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			img, err := Build(tt.v)
			if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("err = %v, want ErrInvalid containing %q", err, tt.want)
			}
			if img != nil {
				t.Error("image returned with an error")
			}
		})
	}
}

func manyFiles(n int) []File {
	var fs []File
	for i := range n {
		fs = append(fs, File{Name: strings.Repeat(string(rune('a'+i)), MaxNameLen)})
	}
	return fs
}

// TestNoTempFiles: Build works with TMPDIR pointing at a directory that
// does not exist (a writer that stages files would fail).
func TestNoTempFiles(t *testing.T) {
	t.Setenv("TMPDIR", t.TempDir()+"/missing")
	if _, err := Build(seedVolume()); err != nil {
		t.Fatal(err)
	}
}

// FuzzBuild: any volume is refused with ErrInvalid or reads back, through
// an independent reader, with its label, names and contents exact and the
// size Size reports.
func FuzzBuild(f *testing.F) {
	f.Add("cidata", "user-data", []byte("#cloud-config\n"), "meta-data", []byte("instance-id: x\n"), "network-config", []byte(""))
	f.Add("CIDATA", "a.b", []byte{0, 0xff}, "a", bytes.Repeat([]byte("z"), 5000), "", []byte(nil))
	f.Add("", "x", []byte(nil), "x", []byte(nil), "Y", []byte(nil))
	f.Fuzz(func(t *testing.T, label, n1 string, d1 []byte, n2 string, d2 []byte, n3 string, d3 []byte) {
		v := Volume{Label: label}
		for _, f := range []File{{n1, d1}, {n2, d2}, {n3, d3}} {
			if f.Name != "" {
				v.Files = append(v.Files, f)
			}
		}
		img, err := Build(v)
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("error not ErrInvalid: %v", err)
			}
			return
		}
		got, files := readBack(t, img)
		if got != label {
			t.Fatalf("label %q, want %q", got, label)
		}
		var sizes []int
		for _, f := range v.Files {
			if files[f.Name] != string(f.Data) {
				t.Fatalf("%q changed: %q -> %q", f.Name, f.Data, files[f.Name])
			}
			sizes = append(sizes, len(f.Data))
		}
		if len(files) != len(v.Files) {
			t.Fatalf("files %v, want %d", files, len(v.Files))
		}
		if int64(len(img)) != Size(sizes...) {
			t.Fatalf("size %d, Size %d", len(img), Size(sizes...))
		}
	})
}
