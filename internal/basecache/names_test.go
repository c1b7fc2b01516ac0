package basecache

import (
	"strings"
	"testing"
	"time"

	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/naming"
	"go.uber.org/goleak"
	"pgregory.net/rapid"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// Generators following the provider rules. Alphabets are small on purpose so
// that '-' and '.' show up often and collisions would be found.
func genLabel(t *rapid.T, label string, dots bool, max int) string {
	alpha := "ab1-"
	if dots {
		alpha = "ab1-."
	}
	return rapid.Custom(func(t *rapid.T) string {
		n := rapid.IntRange(1, max).Draw(t, "len")
		b := make([]byte, n)
		for i := range b {
			b[i] = alpha[rapid.IntRange(0, len(alpha)-1).Draw(t, "c")]
		}
		return string(b)
	}).Filter(func(s string) bool {
		if dots {
			return validKey(s) == nil
		}
		return naming.ValidateName("entry", s) == nil
	}).Draw(t, label)
}

func genEntry(t *rapid.T, l string) string { return genLabel(t, l, false, 8) }
func genKey(t *rapid.T, l string) string   { return genLabel(t, l, true, 10) }
func genFormat(t *rapid.T, l string) string {
	return rapid.SampledFrom([]string{imagecache.FormatQCOW2, imagecache.FormatRaw}).Draw(t, l)
}

func TestBaseNameTable(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct{ entry, key, format, want string }{
		{"host1", "ubuntu", "qcow2", "base-host1--ubuntu.qcow2"},
		{"a-b", "c", "raw", "base-a-b--c.raw"},
		{"a", "b-c", "raw", "base-a--b-c.raw"},
		{"e", "deb.12", "qcow2", "base-e--deb.12.qcow2"},
	} {
		t.Run(tt.want, func(t *testing.T) {
			got := BaseName(tt.entry, tt.key, tt.format)
			if got != tt.want {
				t.Fatalf("BaseName = %q, want %q", got, tt.want)
			}
			e, k, f, ok := ParseBaseName(got)
			if !ok || e != tt.entry || k != tt.key || f != tt.format {
				t.Fatalf("ParseBaseName(%q) = %q %q %q %v", got, e, k, f, ok)
			}
		})
	}
}

func TestParseRejects(t *testing.T) {
	t.Parallel()
	for _, n := range []string{
		"base-ubuntu.qcow2", "base-a-b-c.raw", "base--x.raw", "base-a--b.img", "base-a--b", "base-a---b.raw",
		"base-A--b.raw", "other", "", "base-a--b.raw.sha256", "base-a--.raw",
	} {
		t.Run(n, func(t *testing.T) {
			if _, _, _, ok := ParseBaseName(n); ok {
				t.Fatalf("ParseBaseName(%q) accepted", n)
			}
		})
	}
}

// Injective over (entry, key, format), and the base, marker and claim names
// parse back to their parts.
func TestPropertyNamesInjective(t *testing.T) {
	t.Parallel()
	rapid.Check(t, func(t *rapid.T) {
		e1, k1, f1 := genEntry(t, "e1"), genKey(t, "k1"), genFormat(t, "f1")
		e2, k2, f2 := genEntry(t, "e2"), genKey(t, "k2"), genFormat(t, "f2")
		b1, b2 := BaseName(e1, k1, f1), BaseName(e2, k2, f2)
		if (b1 == b2) != (e1 == e2 && k1 == k2 && f1 == f2) {
			t.Fatalf("BaseName(%q,%q,%q)=%q vs BaseName(%q,%q,%q)=%q", e1, k1, f1, b1, e2, k2, f2, b2)
		}
		e, k, f, ok := ParseBaseName(b1)
		if !ok || e != e1 || k != k1 || f != f1 {
			t.Fatalf("ParseBaseName(%q) = %q %q %q %v", b1, e, k, f, ok)
		}
		dg := strings.Repeat(rapid.SampledFrom([]string{"0", "a", "f"}).Draw(t, "d"), 64)
		m := MarkerName(b1, dg)
		if b, d, ok := ParseMarkerName(m); !ok || b != b1 || d != dg {
			t.Fatalf("ParseMarkerName(%q) = %q %q %v", m, b, d, ok)
		}
		if _, _, _, ok := ParseBaseName(m); ok {
			t.Fatalf("marker %q parses as a base", m)
		}
		if !isMarkerOf(b1, m) || (b1 != b2 && isMarkerOf(b2, m)) {
			t.Fatalf("isMarkerOf wrong for %q (b1 %q b2 %q)", m, b1, b2)
		}
		at := time.Unix(0, rapid.Int64Range(0, 1<<62).Draw(t, "ns"))
		c := claimName(b1, at, "0f")
		if b, got, ok := parseClaimName(c); !ok || b != b1 || !got.Equal(at) {
			t.Fatalf("parseClaimName(%q) = %q %v %v", c, b, got, ok)
		}
	})
}

// No produced name equals the older single-entry naming base-<k>.<format>
// for any key k following the key rule. Assumption about the old naming: it
// is exactly "base-" + key + "." + format with a key under the ImageKey rule
// and a format without '-' (qcow2, raw, ...).
func TestPropertyNoCollisionWithOldNaming(t *testing.T) {
	t.Parallel()
	rapid.Check(t, func(t *rapid.T) {
		e, k, f := genEntry(t, "e"), genKey(t, "k"), genFormat(t, "f")
		ok, of := genKey(t, "oldKey"), rapid.SampledFrom([]string{"qcow2", "raw", "img", "iso"}).Draw(t, "oldFormat")
		old := "base-" + ok + "." + of
		b := BaseName(e, k, f)
		produced := []string{b, MarkerName(b, strings.Repeat("a", 64)), claimName(b, time.Unix(1, 0), "ab")}
		for _, p := range produced {
			if p == old {
				t.Fatalf("%q collides with old naming", p)
			}
		}
		if _, _, _, parsed := ParseBaseName(old); parsed {
			t.Fatalf("old name %q parses as ours", old)
		}
		if isMarkerOf(b, old) {
			t.Fatalf("old name %q taken for a marker of %q", old, b)
		}
		if _, _, parsed := parseClaimName(old); parsed {
			t.Fatalf("old name %q parses as a claim", old)
		}
	})
}

func FuzzParseNames(f *testing.F) {
	for _, s := range []string{"base-a--b.raw", "base-a--b.qcow2.sha256-" + strings.Repeat("0", 64), "claim-a--b.raw.12.ab", "base-x.raw", "base-a--x.sha256-y.raw.sha256-" + strings.Repeat("1", 64)} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		if e, k, fm, ok := ParseBaseName(s); ok {
			if BaseName(e, k, fm) != s {
				t.Fatalf("ParseBaseName(%q) does not round-trip", s)
			}
			if !strings.Contains(s, "--") {
				t.Fatalf("accepted %q without separator", s)
			}
		}
		if b, d, ok := ParseMarkerName(s); ok {
			if MarkerName(b, d) != s || !validDigest(d) {
				t.Fatalf("ParseMarkerName(%q) does not round-trip", s)
			}
		}
		if b, at, ok := parseClaimName(s); ok {
			if !strings.HasPrefix(s, claimName(b, at, "")) {
				t.Fatalf("parseClaimName(%q) does not round-trip", s)
			}
		}
	})
}
