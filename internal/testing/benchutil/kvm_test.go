package benchutil

import (
	"os"
	"strings"
	"testing"

	"github.com/egressproxy/egressproxy/internal/domainmeta"
)

// TestDecodeLikeKVM2 checks the diagnostic's decoding against kvm2's own
// test documents: it accepts what kvm2 accepts for a shut-off domain and
// refuses metadata kvm2 treats as malformed.
func TestDecodeLikeKVM2(t *testing.T) {
	raw, err := os.ReadFile("../../../kvm2/testdata/domain-shutoff.xml")
	if err != nil {
		t.Fatal(err)
	}
	doc := string(raw)
	for _, tc := range []struct {
		name    string
		doc     string
		wantErr string
	}{
		{"kvm2 shut-off domain", doc, ""},
		{"no metadata", "<domain type='qemu'><name>x</name></domain>", "no " + domainmeta.Namespace + " metadata"},
		{"port out of range", strings.Replace(doc, ">3128<", ">70000<", 1), "port"},
		{"no owner", strings.Replace(doc, ">operator-a<", "><", 1), "required"},
		{"bad created", strings.Replace(doc, "2026-11-30T11:00:00.123456789Z", "yesterday", 1), "created"},
		{"syntax error before metadata", "<domain><name>x</nam>", "syntax"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := decodeLikeKVM2(tc.doc)
			switch {
			case tc.wantErr == "" && err != nil:
				t.Errorf("decodeLikeKVM2: %v", err)
			case tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)):
				t.Errorf("decodeLikeKVM2 = %v; want an error with %q", err, tc.wantErr)
			}
		})
	}
}
