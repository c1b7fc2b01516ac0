package kvm2

import (
	"strings"
	"testing"

	"github.com/egressproxy/egressproxy/internal/naming"
	"pgregory.net/rapid"
)

var labelGen = rapid.StringMatching(`[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?`).Filter(func(s string) bool {
	return naming.ValidateName("x", s) == nil
})

// Property: the names of two different (entry, name) pairs never collide,
// are valid volume names, and never look like imagecache's volumes.
func TestNamesProperty(t *testing.T) {
	t.Parallel()
	rapid.Check(t, func(t *rapid.T) {
		e1, n1 := labelGen.Draw(t, "entry1"), labelGen.Draw(t, "name1")
		e2, n2 := labelGen.Draw(t, "entry2"), labelGen.Draw(t, "name2")
		d1, d2 := domainName(e1, n1), domainName(e2, n2)
		if (e1 != e2 || n1 != n2) && (d1 == d2 || overlayVolume(d1) == overlayVolume(d2) || seedVolume(d1) == seedVolume(d2)) {
			t.Fatalf("(%s,%s) and (%s,%s) share names %s", e1, n1, e2, n2, d1)
		}
		for _, v := range []string{d1, overlayVolume(d1), seedVolume(d1)} {
			if strings.ContainsAny(v, "/\x00") || len(v) > 255 {
				t.Fatalf("bad volume name %q", v)
			}
			if strings.HasPrefix(v, "base-") || strings.HasPrefix(v, "claim-") {
				t.Fatalf("%q looks like an imagecache volume", v)
			}
		}
		if overlayVolume(d1) == seedVolume(d2) || seedVolume(d1) == overlayVolume(d2) {
			t.Fatalf("overlay and seed names collide: %s %s", d1, d2)
		}
		// The List prefix of one entry never matches another entry's domain.
		if e1 != e2 && strings.HasPrefix(d2, domainPrefix+e1+"--") {
			t.Fatalf("List prefix of %s matches %s", e1, d2)
		}
	})
}
